"""Sweep data and figures for `flashattn io --sweep`: the IO laws and a roofline.

The data is computed without matplotlib (it is also written as JSON); only `write_plots` needs it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from flashattn.iomodel.estimate import H200, AttnShape, Machine
from flashattn.iomodel.standard import standard_attention, standard_attention_io, tiled_attention_io
from flashattn.iomodel.tiled import backward_io, decode_io, forward_backward_io, forward_io

SEQLENS = [2**i for i in range(8, 17)]  # 256 .. 65536
SRAM_KIB = [48, 96, 192, 384]  # on-chip sizes for the Theta(N^2 d^2 / M) curves; H100/H200 have 228 KiB/SM


def sweep_data(shape: AttnShape, machine: Machine = H200) -> dict[str, Any]:
    """Everything the figures show, as plain numbers."""
    d, e = shape.headdim, shape.dtype_bytes
    one_head = AttnShape(1, 1, 1, d, dtype_bytes=e)
    law: dict[str, Any] = {"seqlen": SEQLENS, "headdim": d, "dtype_bytes": e}
    law["standard"] = [standard_attention_io(n, d, elem_bytes=e).total_bytes for n in SEQLENS]
    for kib in SRAM_KIB:
        m = kib * 1024 // e
        law[f"tiled M={kib}KiB"] = [tiled_attention_io(n, d, m, elem_bytes=e).total_bytes for n in SEQLENS]
    ours = [forward_io(replace(one_head, seqlen_q=n, seqlen_k=n), machine=machine) for n in SEQLENS]
    law["ours fwd (no L2)"] = [est.total_bytes_no_l2 for est in ours]
    law["ours fwd (L2-aware)"] = [est.total_bytes for est in ours]

    points: dict[str, list[dict[str, float]]] = {}
    for n in [s for s in SEQLENS if 512 <= s <= 16384]:
        at = replace(shape, seqlen_q=n, seqlen_k=n)
        decode_shape = replace(shape, seqlen_q=1, seqlen_k=n, causal=False)
        for label, est in (
            ("fwd", forward_io(at, machine=machine)),
            ("bwd", backward_io(at, machine=machine)),
            ("fwd+bwd", forward_backward_io(at, machine=machine)),
            ("decode", decode_io(decode_shape, machine=machine)),
            ("standard[naive] fwd+bwd", standard_attention(at, machine=machine)),
        ):
            points.setdefault(label, []).append(
                dict(seqlen=n, intensity=est.intensity, intensity_no_l2=est.flops / est.total_bytes_no_l2,
                     flops=est.flops, bytes=est.total_bytes, peak_extra_bytes=est.peak_extra_bytes)
            )
    where = (f"b={shape.batch}, h={shape.nheads}, h_k={shape.nheads_k}, d={d}"
             + (", causal" if shape.causal else ""))
    return {"law": law, "roofline": points, "shape": where,
            "machine": dict(name=machine.name, flops=machine.matmul_flops, bandwidth=machine.bandwidth)}


def write_plots(data: dict[str, Any], out: Path) -> list[Path]:
    """Render the sweep into PNGs under `out`; raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    law = data["law"]
    n = law["seqlen"]

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(n, law["standard"], "k-", lw=2, label="standard attention  Θ(Nd + N²)")
    for key, values in law.items():
        if key.startswith("tiled"):
            ax.loglog(n, values, "-", label=f"tiled, {key.removeprefix('tiled ')}  Θ(N²d²/M)")
    ax.loglog(n, law["ours fwd (no L2)"], "--", color="tab:red", label="our forward, no L2 reuse")
    ax.loglog(n, law["ours fwd (L2-aware)"], ":", color="tab:red", label="our forward, L2-aware")
    ax.set(xlabel="sequence length N", ylabel="HBM bytes (forward, one head)",
           title=f"Forward HBM traffic, d={law['headdim']}, {law['dtype_bytes']}-byte elements")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "io_vs_seqlen.png"))

    machine = data["machine"]
    peak, bw = machine["flops"], machine["bandwidth"]
    fig, ax = plt.subplots(figsize=(7, 5))
    intensities = [p[key] for pts in data["roofline"].values() for p in pts
                   for key in ("intensity", "intensity_no_l2")]
    lo, hi = min(intensities) / 2, max(intensities) * 2
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof = lambda x: min(peak, bw * x) / 1e12  # noqa: E731
    ax.loglog(xs, [roof(x) for x in xs], "k-", lw=2,
              label=f"{machine['name']}: {peak / 1e12:.0f} TFLOP/s, {bw / 1e12:.2f} TB/s")
    for label, pts in data["roofline"].items():
        x = [p["intensity"] for p in pts]
        (line,) = ax.loglog(x, [roof(i) for i in x], "o-", ms=4, label=label)
        x_no_l2 = [p["intensity_no_l2"] for p in pts]
        if x_no_l2 != x:
            # hollow: the same kernel if L2 served no re-read, which is where tiling alone puts it
            ax.loglog(x_no_l2, [roof(i) for i in x_no_l2], "o--", ms=4, mfc="none", color=line.get_color())
        # label the ends of a series that moves with N; one label where the intensity does not depend on N
        ends = (pts[0], pts[-1]) if pts[-1]["intensity"] > 1.5 * pts[0]["intensity"] else (pts[-1],)
        for p in ends:
            ax.annotate(f"N={p['seqlen']}", (p["intensity"], roof(p["intensity"])), fontsize=6,
                        xytext=(2, -9), textcoords="offset points")
    ax.set(xlabel="arithmetic intensity (executed FLOP / DRAM byte; hollow: no L2 reuse)",
           ylabel="attainable TFLOP/s",
           title=f"Roofline of each kernel (model), N = 512 .. 16384\n{data['shape']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "roofline.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    for label in ("fwd+bwd", "standard[naive] fwd+bwd"):
        pts = data["roofline"][label]
        ax.loglog([p["seqlen"] for p in pts], [p["peak_extra_bytes"] / 2**30 for p in pts], "o-", label=label)
    ax.set(xlabel="sequence length N", ylabel="peak extra memory (GiB)",
           title=f"Peak extra memory, forward + backward\n{data['shape']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "peak_memory.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
