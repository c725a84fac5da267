"""Result tables, built once, rendered as markdown or on the terminal: shapes down, providers across."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..suites import DRAM, Suite, View, lookup

_NOT_SHAPE = ("suite", "provider", "mode")
_COLUMN_NAMES = {
    "headdim": "d",
    "seqlen": "N",
    "causal": "causal",
    "batch": "b",
    "nheads": "h",
    "nheads_k": "h_k",
}
# the order the anchors page reads in: head dim, then length, then causal
_COLUMN_ORDER = (
    "headdim",
    "seqlen",
    "seqlen_q",
    "seqlen_k",
    "causal",
    "batch",
    "nheads",
    "nheads_k",
    "dtype",
)


def error_code(error: str) -> str:
    if error.startswith("OOM") or "out of memory" in error:
        return "OOM"
    if error.startswith("skipped"):
        return "–"
    if error.startswith("wrong result"):
        return "WRONG"
    return "err"


def fmt_value(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


@dataclass
class Table:
    mode: str
    view: View
    columns: list[str]  # shape columns, then providers
    providers: list[str]
    body: list[list[str]]
    fixed: dict[str, object]  # shape fields with one value throughout: printed once, above the table
    ratios: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.mode}: {self.view.label}"


def provider_order(doc: dict) -> list[str]:
    """The order the run asked for (meta.providers), then any others in order of appearance."""
    order = list(doc.get("meta", {}).get("providers") or [])
    for row in doc["rows"]:
        if row["provider"] not in order:
            order.append(row["provider"])
    return order


def mode_order(doc: dict) -> list[str]:
    seen = [r["mode"] for r in doc["rows"]]
    known = [m for m in ("fwd", "bwd", "fwd+bwd") if m in seen]
    return known + sorted(set(seen) - set(known))


def _shape_fields(suite: Suite, rows: list[dict]) -> tuple[list[str], dict[str, object]]:
    fields = [k for k in suite.key_fields if k not in _NOT_SHAPE]
    # one column where q and k always agree: N for seqlen_q == seqlen_k, h for no GQA
    if all(r.get("seqlen_q") == r.get("seqlen_k") for r in rows):
        fields = ["seqlen" if f == "seqlen_q" else f for f in fields if f != "seqlen_k"]
    if all(r.get("nheads") == r.get("nheads_k") for r in rows):
        fields = [f for f in fields if f != "nheads_k"]
    values = {f: {_value(r, f) for r in rows} for f in fields}
    varying = [f for f in fields if len(values[f]) > 1] or fields[:1]
    varying.sort(key=lambda f: _COLUMN_ORDER.index(f) if f in _COLUMN_ORDER else len(_COLUMN_ORDER))
    fixed = {f: next(iter(values[f])) for f in fields if f not in varying}
    return varying, fixed


def _value(row: dict, f: str):
    return row.get("seqlen_q") if f == "seqlen" else row.get(f)


def sort_key(value):
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def build_tables(doc: dict) -> list[Table]:
    suite = lookup(doc["meta"].get("suite") or (doc["rows"][0]["suite"] if doc["rows"] else ""))
    providers = provider_order(doc)
    tables = []
    views = suite.views + ((DRAM,) if any("dram_bytes" in r for r in doc["rows"]) else ())
    for view in views:
        for mode in mode_order(doc):
            rows = [r for r in doc["rows"] if r["mode"] == mode]
            if not any(view.metric in r for r in rows):
                continue
            present = [p for p in providers if any(r["provider"] == p for r in rows)]
            tables.append(_build(suite, view, mode, rows, present))
    return tables


def _build(suite: Suite, view: View, mode: str, rows: list[dict], providers: list[str]) -> Table:
    shape, fixed = _shape_fields(suite, rows)
    by_shape: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault(tuple(_value(r, f) for f in shape), {})[r["provider"]] = r
    body, errors = [], {}
    keys = sorted(by_shape, key=lambda k: tuple(sort_key(v) for v in k))
    for key in keys:
        cells = [fmt_value(v) for v in key]
        for p in providers:
            r = by_shape[key].get(p)
            if r is None:
                cells.append("")
            elif r.get("error"):
                cells.append(error_code(r["error"]))
                errors.setdefault((p, r["error"]), 0)
                errors[(p, r["error"])] += 1
            elif r.get(view.metric) is None:
                cells.append("n/a")
            else:
                cells.append(view.fmt(r[view.metric]))
        body.append(cells)
    table = Table(mode, view, [_COLUMN_NAMES.get(f, f) for f in shape] + providers, providers, body, fixed)
    table.ratios = _ratios(suite, view, providers, [by_shape[k] for k in keys])
    table.errors = [f"{p}: {e}" + (f" ({n} shapes)" if n > 1 else "") for (p, e), n in errors.items()]
    return table


def _ratios(suite: Suite, view: View, providers: list[str], groups: list[dict[str, dict]]) -> list[str]:
    base = suite.baseline if suite.baseline in providers else None
    if base is None:
        return []
    lines = []
    for other in providers:
        if other == base:
            continue
        ratios = []
        for g in groups:
            a, b = (g.get(base, {}).get(view.metric), g.get(other, {}).get(view.metric))
            if a and b and not g[base].get("error") and not g[other].get("error"):
                ratios.append(a / b)
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            spread = f"{min(ratios):.2f}x to {max(ratios):.2f}x"
            lines.append(f"{base} / {other}: {geo:.2f}x geomean ({spread}, {len(ratios)} shapes)")
    if lines:
        side = "above" if view.higher_is_better else "below"
        lines.insert(0, f"ratios of {view.label}, {side} 1 favours {base}:")
    return lines
