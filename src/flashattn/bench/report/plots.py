"""PNG plots: one figure per (view, mode), one panel per combination of the suite's panel fields (head dim x
causal), one line per provider against sequence length. Skipped with a warning where matplotlib is missing."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

from ..suites import lookup
from .tables import fmt_value, mode_order, provider_order, sort_key

_MARKERS = "osD^v<>ph*"


def render_plots(doc: dict, out_dir: Path) -> list[Path]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed: no PNG plots (pip install matplotlib)", stacklevel=2)
        return []
    suite = lookup(doc["meta"].get("suite", ""))
    providers = provider_order(doc)
    paths = []
    for view in (v for v in suite.views if v.plot):
        for mode in mode_order(doc):
            rows = [r for r in doc["rows"] if r["mode"] == mode]
            if not rows or not any(r.get(view.metric) is not None for r in rows):
                continue
            panel_values = [sorted({r.get(f) for r in rows}, key=sort_key) for f in suite.panel_fields]
            panels = list(itertools.product(*panel_values))
            # fixed margins: constrained layout measures every tick label and takes seconds per figure
            width = max(5.5, 4.2 * len(panels))
            fig = Figure(figsize=(width, 3.8))
            fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=0.14, top=0.84, wspace=0.28)
            axes = fig.subplots(1, len(panels), squeeze=False)[0]
            for ax, panel in zip(axes, panels, strict=True):
                where = dict(zip(suite.panel_fields, panel, strict=True))
                in_panel = [r for r in rows if all(r.get(f) == v for f, v in where.items())]
                _draw_panel(ax, in_panel, providers, suite.x_field, view)
                ax.set_title(", ".join(f"{f}={fmt_value(v)}" for f, v in where.items()))
            axes[0].set_ylabel(view.label)
            axes[-1].legend(fontsize="small")
            gpu = doc["meta"].get("gpu", "")
            fig.suptitle(f"{doc['meta'].get('suite', '')} suite, {mode} ({gpu})")
            path = out_dir / f"{doc['meta'].get('suite', 'bench')}-{mode.replace('+', '')}-{view.metric}.png"
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110)
            paths.append(path)
    return paths


def _draw_panel(ax, rows: list[dict], providers: list[str], x_field: str, view) -> None:
    for i, p in enumerate(providers):
        mine = sorted((r for r in rows if r["provider"] == p), key=lambda r: r.get(x_field) or 0)
        ok = [r for r in mine if not r.get("error") and r.get(view.metric) is not None]
        oom = next((r[x_field] for r in mine if (r.get("error") or "").startswith("OOM")), None)
        if not ok and oom is None:
            continue
        xs = [r[x_field] for r in ok]
        ys = [r[view.metric] / view.plot_scale for r in ok]
        (line,) = ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], label=p)
        if oom is not None:
            # where it first ran out of memory: a cross near the top edge, in the provider's colour
            top, colour = ax.get_xaxis_transform(), line.get_color()
            ax.plot([oom], [0.96], "x", color=colour, markersize=9, transform=top)
            ax.annotate(f"{p} OOM", (oom, 0.96), xycoords=top, xytext=(-6, 0), textcoords="offset points",
                        color=colour, fontsize="small", ha="right", va="center")  # fmt: skip
    ax.set_xscale("log", base=2)
    xs = sorted({r[x_field] for r in rows if isinstance(r.get(x_field), (int, float))})
    ax.set_xticks(xs, [_short(x) for x in xs], minor=False)
    ax.set_xticks([], minor=True)
    if view.log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(x_field)
    ax.grid(True, which="both", alpha=0.3)


def _short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
