"""End-of-run summary on the terminal: rich tables when rich is installed, aligned plain text otherwise."""

from __future__ import annotations

from .tables import Table, build_tables, fmt_value


def _plain(t: Table) -> str:
    widths = [
        max(len(c), *(len(row[i]) for row in t.body)) if t.body else len(c) for i, c in enumerate(t.columns)
    ]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    out = [
        t.title
        + ("  (" + ", ".join(f"{k}={fmt_value(v)}" for k, v in t.fixed.items()) + ")" if t.fixed else "")
    ]
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
        for t in tables:
            print("\n" + _plain(t))
        return
    console = Console()
    for t in tables:
        caption = ", ".join(f"{k}={fmt_value(v)}" for k, v in t.fixed.items()) or None
        rt = RichTable(title=t.title, caption=caption)
        for c in t.columns:
            rt.add_column(c, justify="right")
        for row in t.body:
            rt.add_row(*row)
        console.print(rt)
        for r in t.ratios:
            console.print(f"  {r}", markup=False, highlight=False)
