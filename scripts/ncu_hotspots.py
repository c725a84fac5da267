"""The hot SASS instructions of an Nsight Compute source page (`ncu -i REP --page source --csv --print-source
sass`, which the device stage profile-training writes as sass-train-*.csv): per column of counts (stall
samples, shared-memory wavefronts, excessive ones), the instructions that hold most of it with a few
instructions around each, and the totals by opcode. Read on any machine.

    python scripts/ncu_hotspots.py sass-train-ours.csv [--column "Warp Stall Sampling (All"] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def read_page(path: str) -> tuple[list[str], list[dict]]:
    """The page's header and rows (ncu prints lines of its own before the CSV: skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line), None)
    if start is None:
        sys.exit(f"{path}: no source page header (first lines: {lines[:3]})")
    reader = csv.DictReader(lines[start:])
    return list(reader.fieldnames or ()), list(reader)


def number(cell: str | None) -> float:
    try:
        return float((cell or "").replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--column", action="append",
                        help="a count column (a prefix of its name); default: every stall and wavefront one")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--context", type=int, default=2, help="instructions shown before each hot one")
    args = parser.parse_args()
    header, rows = read_page(args.csv)
    source = next(h for h in header if h.strip('"') == "Source")
    wanted = args.column or ["Warp Stall Sampling (All", "L1 Wavefronts Shared"]
    columns = [h for h in header if any(h.startswith(w) for w in wanted)]
    print(f"{len(rows)} instructions; columns: {', '.join(columns)}")
    for column in columns:
        counts = [number(r.get(column)) for r in rows]
        total = sum(counts)
        if not total:
            continue
        print(f"\n== {column}: {total:,.0f}")
        by_op = collections.Counter()
        for r, c in zip(rows, counts, strict=True):
            by_op[(r[source].split() or ["?"])[0].split(".")[0]] += c
        print("  by opcode: " + "  ".join(f"{op} {c / total:.1%}" for op, c in by_op.most_common(10)))
        hot = sorted(range(len(rows)), key=counts.__getitem__, reverse=True)[: args.top]
        for i in sorted(hot):
            print(f"  -- {counts[i] / total:.1%} at {i}")
            for j in range(max(0, i - args.context), i + 1):
                print(f"   {j:5d} {counts[j]:>10,.0f}  {rows[j][source].strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
