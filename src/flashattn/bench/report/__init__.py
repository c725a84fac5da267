"""Turning a results JSON into markdown, PNG plots and terminal tables; works without a GPU."""

from __future__ import annotations

from pathlib import Path

from .compare import compare_markdown
from .markdown import render_markdown
from .plots import render_plots
from .terminal import print_tables

__all__ = ["compare_markdown", "print_tables", "render", "render_markdown", "render_plots"]


def render(doc: dict, out_dir: Path | str, *, plots: bool = True) -> list[Path]:
    """Write `<suite>.md` (and the PNGs) for a results document into out_dir; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{doc['meta'].get('suite', 'bench')}.md"
    md.write_text(render_markdown(doc))
    return [md, *(render_plots(doc, out_dir) if plots else [])]
