"""The results file: `{"meta": {...}, "rows": [...]}`, one row per (case, provider, mode)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .case import Case

# what identifies a measurement when runs are merged (suites with extra shape fields extend Suite.key_fields)
KEY_FIELDS = (
    "suite",
    "provider",
    "mode",
    "dtype",
    "batch",
    "nheads",
    "nheads_k",
    "seqlen_q",
    "seqlen_k",
    "headdim",
    "causal",
)
# every row has these; suites may add more (a decode suite: kv_len, page_size, tbps)
ROW_FIELDS = KEY_FIELDS + (
    "ms",
    "tflops",
    "peak_mem_bytes",
    "error",
    "max_abs_err",
    "first_call_s",
    "checked_on",
)


def new_row(suite: str, provider: str, mode: str, case: Case) -> dict[str, Any]:
    row: dict[str, Any] = {"suite": suite, "provider": provider, "mode": mode}
    row.update(case.fields())
    row.update(
        ms=None,
        tflops=None,
        peak_mem_bytes=None,
        host_us=None,
        error=None,
        max_abs_err=None,
        rel_err=None,
        first_call_s=None,
        checked_on=None,
    )
    return row


def _clean(obj: Any) -> Any:
    """Strict JSON: NaN/inf become null (an error field says why)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write(path: Path, doc: dict) -> None:
    """Atomic write, so a run killed mid-way leaves the previous complete file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def load(path: Path | str) -> dict:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "rows" not in doc or "meta" not in doc:
        raise ValueError(f"{path} is not a flashattn bench results file (expected keys 'meta' and 'rows')")
    return doc


def row_key(row: dict, key_fields: tuple[str, ...] = KEY_FIELDS) -> tuple:
    return tuple(row.get(k) for k in key_fields)


def merge_rows(old: list[dict], new: list[dict], key_fields: tuple[str, ...] = KEY_FIELDS) -> list[dict]:
    """Old rows not measured again, then the new ones: re-running part of a sweep replaces just that part."""
    fresh = {row_key(r, key_fields) for r in new}
    return [r for r in old if row_key(r, key_fields) not in fresh] + list(new)
