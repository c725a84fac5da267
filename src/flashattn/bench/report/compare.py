"""Two runs side by side (before/after a kernel change, or two machines): time per shape and the speedup."""

from __future__ import annotations

import math

from ..results import KEY_FIELDS, row_key
from ..suites import lookup
from .tables import fmt_value


def compare_markdown(a: dict, b: dict, label_a: str = "A", label_b: str = "B") -> str:
    suite = lookup(b["meta"].get("suite", ""))
    keys = suite.key_fields if suite.name else KEY_FIELDS
    old = {row_key(r, keys): r for r in a["rows"]}
    shape_fields = [k for k in keys if k not in ("suite", "provider", "mode")]
    lines = [
        f"# {label_a} vs {label_b}",
        "",
        f"- {label_a}: {a['meta'].get('gpu')} {a['meta'].get('date')} git {a['meta'].get('git_sha')}",
        f"- {label_b}: {b['meta'].get('gpu')} {b['meta'].get('date')} git {b['meta'].get('git_sha')}",
        "",
        f"Speedup = {label_a} ms / {label_b} ms (above 1: {label_b} is faster).",
        "",
        "| provider | mode | " + " | ".join(shape_fields) + f" | {label_a} ms | {label_b} ms | speedup |",
        "|" + "---|" * (len(shape_fields) + 5),
    ]
    speedups: dict[tuple[str, str], list[float]] = {}
    for r in b["rows"]:
        o = old.get(row_key(r, keys))
        if o is None or not o.get("ms") or not r.get("ms"):
            continue
        s = o["ms"] / r["ms"]
        speedups.setdefault((r["provider"], r["mode"]), []).append(s)
        shape = " | ".join(fmt_value(r.get(f)) for f in shape_fields)
        lines.append(
            f"| {r['provider']} | {r['mode']} | {shape} | {o['ms']:.3g} | {r['ms']:.3g} | {s:.2f}x |"
        )
    lines.append("")
    for (p, m), s in speedups.items():
        geo = math.exp(sum(math.log(x) for x in s) / len(s))
        lines.append(f"- {p} {m}: geomean speedup {geo:.2f}x over {len(s)} shapes")
    if not speedups:
        lines.append("No shape was measured in both runs.")
    return "\n".join(lines) + "\n"
