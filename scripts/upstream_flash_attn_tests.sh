#!/usr/bin/env bash
# flash_attn 2.8's own test file, unmodified, on flashattn through flashattn.compat (on a GPU machine).
#
#   scripts/upstream_flash_attn_tests.sh PATH/TO/test_flash_attn.py [subset|full] [pytest args ...]
#
# The file is flash_attn's tests/test_flash_attn.py at 2.8.4 (Dao-AILab/flash-attention, a third party's
# code: fetch it, never commit it). It is copied into the ignored folder .upstream/run/ next to a conftest.py
# (scripts/upstream_flash_attn_conftest.py) that calls flashattn.compat.install() before the file imports
# flash_attn. `subset` (the default) keeps a fixed, representative ~720 of its ~509,000 parametrizations
# (about 10 minutes on an H200 with `-n 14`; the conftest says how they are chosen); `full` runs all of
# them (hours).
# The file needs einops (pure Python): installed, or its wheel in .upstream/ (`pip download einops -d
# .upstream` on a machine with network). The summary's last line is the pass count; the full log is
# .upstream/run/pytest.log.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 PATH/TO/test_flash_attn.py [subset|full] [pytest args ...]" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
file=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
mode=${2:-subset}
shift $(( $# >= 2 ? 2 : 1 ))
case "$mode" in
  subset) export UPSTREAM_SUBSET=1 ;;
  full) export UPSTREAM_SUBSET=0 ;;
  *) echo "mode must be subset or full, got $mode" >&2; exit 2 ;;
esac
run="$root/.upstream/run"
mkdir -p "$run"
cp "$file" "$run/test_flash_attn.py"
cp "$root/scripts/upstream_flash_attn_conftest.py" "$run/conftest.py"
PY=${PYTHON:-python3}
extra=""
if ! "$PY" -c "import einops" 2>/dev/null; then
  wheel=$(ls "$root"/.upstream/einops-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "the upstream tests import einops: install it, or put its wheel in .upstream/ (pip download einops -d .upstream)" >&2
    exit 2
  fi
  extra=":$wheel"  # a pure-Python wheel imports from the zip itself
fi
export PYTHONPATH="$root/src$extra${PYTHONPATH:+:$PYTHONPATH}"
cd "$run"
# -rf: the failures' one-line summary (the full log is kept); the last line is the count
"$PY" -m pytest test_flash_attn.py -q -p no:cacheprovider -rf -o addopts="" --rootdir "$run" "$@" 2>&1 \
  | tee "$run/pytest.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
