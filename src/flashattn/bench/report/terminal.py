"""End-of-run summary: rich tables on a terminal, aligned plain text in logs or where rich is missing."""

from __future__ import annotations

import sys

from .tables import Table, build_tables, fmt_value


def _fixed(t: Table) -> str:
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in t.fixed.items())


def _plain(t: Table) -> str:
    widths = [max([len(c), *(len(row[i]) for row in t.body)]) for i, c in enumerate(t.columns)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [t.title + (f"  ({_fixed(t)})" if t.fixed else "")]
    out.append(fmt.format(*t.columns))
    out += [fmt.format(*row) for row in t.body]
    out += [f"  {r}" for r in t.ratios]
    return "\n".join(out)


def print_tables(doc: dict) -> None:
    tables = build_tables(doc)
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        Console = None
    # off a terminal rich wraps to 80 columns and elides provider names; plain text keeps every cell whole
    if Console is None or not sys.stdout.isatty():
        for t in tables:
            print("\n" + _plain(t))
        return
    console = Console()
    for t in tables:
        rt = RichTable(title=t.title, caption=_fixed(t) or None)
        for c in t.columns:
            rt.add_column(c, justify="right")
        for row in t.body:
            rt.add_row(*row)
        console.print(rt)
        for r in t.ratios:
            console.print(f"  {r}", markup=False, highlight=False)
