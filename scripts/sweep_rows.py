"""What scripts/fwd_sweep.py and scripts/bwd_sweep.py share: their shape list, a kernel loaded from a file for
an A/B in one process, and one timed variant as a JSON row."""

import importlib.util
import json
import os


def shapes(var: str, default: list) -> list:
    """(batch, N, causal) triples: the environment variable var ("16,1024,1;1,16384,0") or default."""
    if not os.environ.get(var):
        return default
    parts = (part.split(",") for part in os.environ[var].split(";"))
    return [(int(b), int(n), c == "1") for b, n, c in parts]


def kernel_from_file(path: str, name: str):
    """The kernel `name` of the Python file at path (an earlier or a trial version of a package kernel)."""
    spec = importlib.util.spec_from_file_location(f"sweep_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def record(rows: list, path: str, row: dict, measure, describe) -> None:
    """measure(row) fills row; describe(row) says it in a line. A variant that fails to compile or run is
    reported, not fatal. The rows so far are rewritten to path after each one (a timeout keeps them)."""
    try:
        measure(row)
        print(f"  {row['variant']:20} {describe(row)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a variant that fails to compile or run is a result
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"  {row['variant']:20} {row['error']}", flush=True)
    rows.append(row)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
