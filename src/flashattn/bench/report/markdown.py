"""`<suite>.md`: the tables, ratio lines and errors of a run, with enough context to read them cold."""

from __future__ import annotations

from ..suites import lookup
from .tables import Table, build_tables, fmt_value

_META_LINE = ("gpu", "torch", "triton", "cuda", "cudnn", "git_sha", "date")
# a row whose host time per call reaches this share of its measured time may be timing the host: do_bench's
# L2 flush before each call hides host work only up to the flush's GPU time (~83 us on the H200)
_HOST_BOUND_SHARE = 0.8


def _table_md(t: Table) -> list[str]:
    lines = [f"## {t.title}", ""]
    if t.fixed:
        lines += ["Fixed: " + ", ".join(f"{k}={fmt_value(v)}" for k, v in t.fixed.items()), ""]
    lines.append("| " + " | ".join(t.columns) + " |")
    lines.append("|" + "---|" * len(t.columns))
    lines += ["| " + " | ".join(row) + " |" for row in t.body]
    lines.append("")
    if t.ratios:
        lines += [t.ratios[0][0].upper() + t.ratios[0][1:], ""] + [f"- {r}" for r in t.ratios[1:]] + [""]
    if t.errors:
        lines += ["Not measured:", ""] + [f"- {e}" for e in t.errors] + [""]
    return lines


def _host_bound(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        host, ms = r.get("host_us"), r.get("ms")
        if host is not None and ms and host >= _HOST_BOUND_SHARE * ms * 1e3:
            shape = f"d={r['headdim']} N={r['seqlen_q']}" + (" causal" if r.get("causal") else "")
            lines.append(f"- {r['provider']} {r['mode']} {shape}: {ms * 1e3:.0f} us measured, "
                         f"host {host:.0f} us per call")
    if not lines:
        return []
    head = (f"Host-bound rows (host time per call >= {_HOST_BOUND_SHARE:.0%} of the measured time; `ms` may "
            "count host time here, see `host_us` in the JSON):")
    return [head, ""] + lines + [""]


def render_markdown(doc: dict) -> str:
    meta = doc["meta"]
    suite = lookup(meta.get("suite", ""))
    lines = [f"# flashattn bench: {meta.get('suite', '?')} suite", ""]
    if suite.description:
        lines += [suite.description, ""]
    lines.append(" · ".join(f"{k} {meta[k]}" for k in _META_LINE if meta.get(k) is not None))
    lines.append("")
    if meta.get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    if meta.get("timer"):
        lines += [
            f"Timing: {meta['timer']}; first calls (compilation, autotuning) are reported apart as "
            "`first_call_s` in the JSON.",
            "",
        ]
    lines += [
        "TFLOP/s by the FlashAttention convention: forward 4·b·h·sq·sk·d (half when causal), backward 2.5x, "
        "forward+backward 3.5x. Every provider was checked against the oracle "
        f"({meta.get('reference', 'flashattn.reference')}) before timing; one that disagreed is marked WRONG "
        "and was not timed. Cells: OOM = out of memory, – = skipped (reason below), err = failed to run.",
        "",
    ]
    for table in build_tables(doc):
        lines += _table_md(table)
    lines += _host_bound(doc["rows"])
    return "\n".join(lines).rstrip() + "\n"
