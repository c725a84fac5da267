"""Nsight Compute from Python: the command line, the profiled child, and ncu's CSV parsed into DRAM bytes.

`flashattn bench --ncu` runs, after the timings, one child process per measured row under

    ncu --clock-control none --profile-from-start off --metrics dram__bytes_read.sum,... python -m
        flashattn.bench.ncu --row '<the row as JSON>'

The child rebuilds the row's case and provider as the runner did, warms the call up (compilation, tile
choice, the allocator's cache), and brackets exactly one call of the row's mode with cudaProfilerStart/Stop;
the parent sums the DRAM bytes of the kernels ncu saw and adds `dram_read_bytes`, `dram_write_bytes`,
`dram_bytes` and `ncu_kernels` to the row (or `ncu_error`). Each row costs a process start and a compile
(~10-20 s): narrow the run (--providers, --seqlens) before adding --ncu. scripts/ncu_io.py uses the same
pieces to set the bytes beside flashattn.iomodel's prediction.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
# --cache-control all (ncu's default, spelled out): L2 is flushed before each kernel, so nothing one kernel
# leaves in L2 lowers the next one's DRAM reads; the model assumes no reuse across kernels either.
NCU_FLAGS = ("--clock-control", "none", "--profile-from-start", "off", "--metrics", ",".join(METRICS),
             "--csv", "--print-units", "base", "--cache-control", "all", "--target-processes", "all")
WARMUP_CALLS = 2

# -- ncu's CSV

_BYTE_UNITS = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9,
               "gb": 1e9, "tbyte": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_TIME_UNITS = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9,
               "s": 1e9}
_FIELDS = {"dram__bytes_read.sum": "dram_read_bytes", "dram__bytes_write.sum": "dram_write_bytes",
           "gpu__time_duration.sum": "time_ns"}


def _number(text: str) -> float | None:
    text = text.strip().strip('"')
    if not text or text.lower() in ("n/a", "nan"):
        return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")  # thousands separators
    elif "," in text and "." not in text:
        text = text.replace(",", ".")  # a decimal comma (non-C locale)
    return float(text)


def _scaled(metric: str, value: float | None, unit: str) -> float | None:
    if value is None:
        return None
    table = _TIME_UNITS if metric.startswith("gpu__time") else _BYTE_UNITS
    unit = unit.strip().lower()
    if unit and unit not in table:
        raise ValueError(f"unit {unit!r} of {metric} is not known; expected one of {sorted(table)}")
    return value * table.get(unit, 1)


def parse_ncu_csv(text: str) -> list[dict]:
    """Per-kernel metrics from `ncu --csv` output: [{id, kernel, dram_read_bytes, dram_write_bytes, time_ns}].

    Accepts the long format (a row per kernel and metric: "Metric Name", "Metric Unit", "Metric Value") and
    the wide `--page raw` format (a column per metric, units in the row after the header). Lines before the
    header (==PROF== messages, the child's own output) are skipped; values come back in bytes and nanoseconds.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.DictReader(line for line in lines[start:] if line.startswith('"')))
    kernels: dict[int, dict] = {}

    def entry(row: dict) -> dict:
        kid = int(row["ID"])
        return kernels.setdefault(kid, {"id": kid, "kernel": row.get("Kernel Name", ""),
                                        **{field: None for field in _FIELDS.values()}})

    long_format = "Metric Name" in (rows[0] if rows else {})
    units = {}
    for row in rows:
        if not (row.get("ID") or "").strip().isdigit():
            units = units or row  # the wide format's units row
            continue
        if long_format:
            metric = row["Metric Name"]
            if metric in _FIELDS:
                value = _number(row["Metric Value"])
                entry(row)[_FIELDS[metric]] = _scaled(metric, value, row["Metric Unit"])
        else:
            for metric, field in _FIELDS.items():
                if metric in row:
                    entry(row)[field] = _scaled(metric, _number(row[metric]), units.get(metric, ""))
    return [kernels[k] for k in sorted(kernels)]


def summarize(kernels: list[dict]) -> dict:
    """Sum one call's kernels."""
    total = {field: sum(k[field] or 0 for k in kernels) for field in _FIELDS.values()}
    return {"kernels": len(kernels), **total}


# -- the parent


def find_ncu(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("ncu")
    if found:
        return found
    candidates = [Path("/usr/local/cuda/bin/ncu"), *sorted(Path("/opt/nvidia").glob("nsight-compute*/ncu"))]
    return next((str(p) for p in candidates if p.exists()), None)


def profile(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Run an ncu command line; {"kernels", "measured" (summed), "stdout", "stderr"} or {"error", ...}."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "stdout": "", "stderr": ""}
    kernels = parse_ncu_csv(proc.stdout)
    out = {"stdout": proc.stdout, "stderr": proc.stderr}
    if proc.returncode or not kernels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {**out, "error": " | ".join(tail) or f"exit {proc.returncode}, no kernels profiled"}
    return {**out, "kernels": kernels, "measured": summarize(kernels)}


def annotate_rows(rows: list[dict], ncu: str, *, seed: int = 0, timeout: float = 300.0,
                  progress=print) -> None:
    """Profile every timed row (ms set, no error) in its own child; write the bytes into the row."""
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    for row in rows:
        if row.get("ms") is None or row.get("error"):
            continue
        cmd = [ncu, *NCU_FLAGS, sys.executable, "-m", "flashattn.bench.ncu", "--seed", str(seed), "--row",
               json.dumps(row)]
        result = profile(cmd, timeout, env=env)
        if "error" in result:
            row["ncu_error"] = result["error"][:300]
        else:
            m = result["measured"]
            row.update(dram_read_bytes=m["dram_read_bytes"], dram_write_bytes=m["dram_write_bytes"],
                       dram_bytes=m["dram_read_bytes"] + m["dram_write_bytes"], ncu_kernels=m["kernels"])
        done = row.get("ncu_error") or f"{row['dram_bytes'] / 1e9:.3f} GB in {row['ncu_kernels']} kernels"
        progress(f"ncu {row['provider']} {row['mode']}: {done}")


# -- the child


def _case_of(row: dict):
    from dataclasses import fields

    from .case import Case
    from .results import ROW_FIELDS

    own = {f.name for f in fields(Case)} - {"extra"}
    skip = {"suite", "provider", "mode", "rel_err", *ROW_FIELDS}
    extra = {k: v for k, v in row.items() if k not in own and k not in skip}
    return Case(**{k: row[k] for k in own}, extra=extra)


def child(row: dict, seed: int = 0) -> int:
    """Set up the row's provider on its case, warm up, and profile one call of the row's mode."""
    import torch

    from . import providers as provider_registry
    from .runner import RunConfig, Runner, _timed_call
    from .suites import lookup

    suite = lookup(row["suite"])  # importing a suite registers its own providers (decode's kvcache ones)
    case = _case_of(row)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runner = Runner(RunConfig(suite=suite, cases=[case], providers=[row["provider"]], modes=(row["mode"],),
                              device=device, seed=seed))
    inputs = runner._make_inputs(case)  # the same seeded inputs as the timed run
    prep = provider_registry.get(row["provider"]).setup(case, inputs.q, inputs.k, inputs.v)
    with prep.context():
        from .providers.base import from_bshd

        call = _timed_call(row["mode"], prep, from_bshd(inputs.dout, prep.layout))
        for _ in range(WARMUP_CALLS):
            call()
        if device.type != "cuda":  # a CPU run (tests) has nothing to profile: the plumbing is what it checks
            call()
            return 0
        profile_one(call)
    return 0


def profile_one(call) -> None:
    """Run `call` once between cudaProfilerStart and Stop (what ncu --profile-from-start off records),
    nothing of the work queued before it inside."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the child `flashattn bench --ncu` runs under ncu")
    parser.add_argument("--row", required=True, help="a results row as JSON")
    parser.add_argument("--seed", type=int, default=0, help="the bench run's --seed (same inputs)")
    args = parser.parse_args(argv)
    return child(json.loads(args.row), args.seed)


if __name__ == "__main__":
    sys.exit(main())
