#!/usr/bin/env bash
# A copy of flashattn at another revision, importable beside this tree's under another name, for A/B timing
# in one process (scripts/host_ab.py, the bench's flashattn-baseline): `git archive REV src/flashattn` into
# .baseline/src/NAME (.gitignore names it; carry .baseline to the device), its imports and its torch.library namespace
# renamed to NAME, and REVISION, the revision's short hash.
#   bash scripts/vendor_tree.sh REV NAME
set -euo pipefail
rev=$1 name=$2
out=.baseline/src
rm -rf "$out/$name" && mkdir -p "$out"
tmp=$(mktemp -d)
git archive "$rev" src/flashattn | tar -x -C "$tmp"
mv "$tmp/src/flashattn" "$out/$name" && rm -rf "$tmp"
find "$out/$name" -name '*.py' -exec sed -i -E "s/\\bflashattn([.:]|\\b)/$name\\1/g" {} +
git rev-parse --short "$rev" > "$out/$name/REVISION"  # the rows of flashattn-baseline name it
echo "$out/$name from $rev"
