"""`flashattn io`: the HBM-traffic model for one shape, standard attention alongside, and optional plots.

    flashattn io --batch 64 --nheads 16 --seqlen-q 1024 --headdim 64 --kernel fwd+bwd
    flashattn io --nheads 32 --nheads-k 8 --seqlen-k 65536 --kernel decode --json
    flashattn io --sweep --out benchmarks/results/io/

`flashattn.cli` wires `add_arguments` and `run` to the `io` subcommand; `python -m flashattn.io_cli` also
works.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from flashattn.iomodel import (
    H200,
    AttnShape,
    IOEstimate,
    backward_io,
    decode_io,
    dtype_bytes,
    forward_backward_io,
    forward_io,
    standard_attention,
)

KERNELS = ("fwd", "bwd", "fwd+bwd", "decode")
DEFAULT_OUT = Path("benchmarks/results/io")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("shape (defaults: GPT-2 medium, the FlashAttention paper's IO example)")
    shape.add_argument("--batch", type=int, default=64)
    shape.add_argument("--nheads", type=int, default=16)
    shape.add_argument("--nheads-k", type=int, default=None, help="kv heads (GQA/MQA); default nheads")
    shape.add_argument("--seqlen-q", type=int, default=1024)
    shape.add_argument("--seqlen-k", type=int, default=None, help="default seqlen-q")
    shape.add_argument("--headdim", type=int, default=64)
    shape.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    shape.add_argument("--causal", action="store_true")
    shape.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                       help="sliding window, -1 = unbounded")
    shape.add_argument("--density", type=float, default=1.0, help="block-sparse fraction of tiles kept")
    model = parser.add_argument_group("model")
    model.add_argument("--kernel", default="all", choices=(*KERNELS, "all"))
    model.add_argument("--decode-seqlen-q", type=int, default=1,
                       help="query tokens per sequence for the decode model (keys: --seqlen-k)")
    model.add_argument("--num-splits", type=int, default=None, help="decode splits; default: a heuristic")
    model.add_argument("--page-size", type=int, default=None, help="paged KV cache: tokens per page")
    model.add_argument("--ctas-per-sm", type=int, default=1, help="resident programs per SM (L2 model)")
    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    output.add_argument("--sweep", action="store_true",
                        help="also write sweep data (JSON) and PNGs: bytes vs N, roofline, peak memory")
    output.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where --sweep writes (default {DEFAULT_OUT})")


def shape_from_args(args: argparse.Namespace) -> AttnShape:
    return AttnShape(
        batch=args.batch, nheads=args.nheads, nheads_k=args.nheads_k, seqlen_q=args.seqlen_q,
        seqlen_k=args.seqlen_k, headdim=args.headdim, dtype_bytes=dtype_bytes(args.dtype), causal=args.causal,
        window=tuple(args.window), density=args.density,
    )


def estimates(shape: AttnShape, kernel: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """For each requested kernel: our estimate, standard attention's two recipes at the same shape."""
    sections = {}
    for name in KERNELS if kernel == "all" else (kernel,):
        at, pass_ = shape, name
        if name == "fwd":
            ours = forward_io(shape, ctas_per_sm=args.ctas_per_sm)
        elif name == "bwd":
            ours = backward_io(shape, ctas_per_sm=args.ctas_per_sm)
        elif name == "fwd+bwd":
            ours = forward_backward_io(shape, ctas_per_sm=args.ctas_per_sm)
        else:
            at, pass_ = replace(shape, seqlen_q=args.decode_seqlen_q), "fwd"
            ours = decode_io(at, num_splits=args.num_splits, page_size=args.page_size)
        sections[name] = dict(
            shape=at,
            ours=ours,
            naive=standard_attention(at, pass_, recipe="naive"),
            paper=standard_attention(at, pass_, recipe="paper"),
        )
    return sections


def run(args: argparse.Namespace) -> int:
    try:
        shape = shape_from_args(args)
        sections = estimates(shape, args.kernel, args)
    except ValueError as err:
        print(f"flashattn io: {err}", file=sys.stderr)
        return 2
    plots: list[str] = []
    if args.sweep:
        plots = _sweep(shape, args.out)
    if args.json:
        print(json.dumps(_as_json(shape, sections, plots), indent=2))
    else:
        print(_report(shape, sections))
        for path in plots:
            print(f"wrote {path}")
    return 0


def _sweep(shape: AttnShape, out: Path) -> list[str]:
    from flashattn.iomodel.plots import sweep_data, write_plots

    data = sweep_data(shape)
    out.mkdir(parents=True, exist_ok=True)
    data_path = out / "sweep.json"
    data_path.write_text(json.dumps(data, indent=2))
    written = [str(data_path)]
    try:
        written += [str(p) for p in write_plots(data, out)]
    except ImportError:
        print("flashattn io: matplotlib is not installed (pip install 'flashattn[bench]'); "
              f"wrote the sweep data to {data_path} but no PNGs", file=sys.stderr)
    return written


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _as_json(shape: AttnShape, sections: dict[str, dict[str, Any]], plots: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": asdict(shape), "machine": asdict(H200), "sections": {}, "plots": plots}
    for name, sec in sections.items():
        ours = sec["ours"]
        out["sections"][name] = {
            "shape": asdict(sec["shape"]),
            "ours": ours.to_dict(),
            "standard_naive": sec["naive"].to_dict(),
            "standard_paper": sec["paper"].to_dict(),
            "ratio_naive": _ratio(sec["naive"].total_bytes, ours.total_bytes),
            "ratio_paper": _ratio(sec["paper"].total_bytes, ours.total_bytes),
            "ratio_naive_no_l2": _ratio(sec["naive"].total_bytes, ours.total_bytes_no_l2),
        }
    return out


_BYTES = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))
_FLOPS = (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("FLOP", 1.0))
_MEMORY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1.0))
_TIME = (("ms", 1e-3), ("us", 1e-6))


def _unit(reference: float, units: tuple[tuple[str, float], ...]) -> tuple[str, float]:
    """The largest unit in which `reference` is at least 1, so a section's own kernel reads naturally."""
    for name, scale in units:
        if reference >= scale:
            return name, scale
    return units[-1]


def _describe(shape: AttnShape) -> str:
    dtype = {1: "fp8", 2: "16-bit", 4: "fp32"}.get(shape.dtype_bytes, f"{shape.dtype_bytes}-byte")
    text = (f"batch={shape.batch} nheads={shape.nheads} nheads_k={shape.nheads_k} seqlen_q={shape.seqlen_q} "
            f"seqlen_k={shape.seqlen_k} headdim={shape.headdim} {dtype} causal={shape.causal}")
    if shape.window != (-1, -1):
        text += f" window={shape.window}"
    if shape.density < 1:
        text += f" density={shape.density:g}"
    return text


def _report(shape: AttnShape, sections: dict[str, dict[str, Any]]) -> str:
    m = H200
    lines = [
        f"flashattn io: {_describe(shape)}",
        f"machine: {m.name}, {m.sms} SMs, L2 {m.l2_bytes / 2**20:.0f} MiB "
        f"({m.l2_effective / 2**20:.0f} MiB usable for shared tiles), "
        f"{m.matmul_flops / 1e12:.0f} TFLOP/s matmul, {m.bandwidth / 1e12:.2f} TB/s",
        "read/write/total: DRAM bytes, L2-aware (what ncu is checked against, +-20%); "
        "no-L2: every tile load from DRAM (upper bound).",
        "exec: matmul FLOPs executed (whole tiles); conv: the FlashAttention convention; "
        "FLOP/B: executed FLOPs per L2-aware byte; roofline: max(FLOPs/peak, bytes/bandwidth); "
        "peak: extra memory.",
    ]
    for name, sec in sections.items():
        ours = sec["ours"]
        rows: list[tuple[str, IOEstimate]] = [(name, ours)]
        rows += [(f"  {p.name}", p) for p in ours.parts if len(ours.parts) > 1]
        rows += [(f"standard[naive] ({sec['naive'].detail['kernels']} kernels)", sec["naive"]),
                 (f"standard[paper] ({sec['paper'].detail['kernels']} kernels)", sec["paper"])]
        b_unit, b_scale = _unit(ours.total_bytes, _BYTES)
        f_unit, f_scale = _unit(max(ours.flops, 1), _FLOPS)
        m_unit, m_scale = _unit(max(ours.peak_extra_bytes, 1), _MEMORY)
        t_unit, t_scale = _unit(ours.roofline_time(), _TIME)
        lines += ["", f"== {name}" + ("" if sec["shape"] is shape else f" ({_describe(sec['shape'])})")]
        header = (f"{'':34s}{'read':>10s}{'write':>10s}{'total':>10s}{'no-L2':>10s}{'exec':>9s}{'conv':>9s}"
                  f"{'FLOP/B':>9s}{'roofline':>9s}  {'bound':8s}{'peak':>9s}")
        units = (f"{'':34s}{b_unit:>10s}{b_unit:>10s}{b_unit:>10s}{b_unit:>10s}{f_unit:>9s}{f_unit:>9s}"
                 f"{'':>9s}{t_unit:>9s}  {'':8s}{m_unit:>9s}")
        lines += [header, units, "-" * len(header)]
        for label, est in rows:
            lines.append(
                f"{label:34s}{est.bytes_read / b_scale:10.3f}{est.bytes_written / b_scale:10.3f}"
                f"{est.total_bytes / b_scale:10.3f}{est.total_bytes_no_l2 / b_scale:10.3f}"
                f"{est.flops / f_scale:9.3f}{est.flops_convention / f_scale:9.3f}{est.intensity:9.1f}"
                f"{est.roofline_time() / t_scale:9.3f}  {est.bound(m):8s}"
                f"{est.peak_extra_bytes / m_scale:9.3f}"
            )
        lines.append(
            f"standard/ours bytes: naive {sec['naive'].total_bytes / ours.total_bytes:.1f}x, "
            f"paper {sec['paper'].total_bytes / ours.total_bytes:.1f}x (L2-aware); "
            f"naive {sec['naive'].total_bytes / ours.total_bytes_no_l2:.1f}x against our no-L2 bound; "
            f"peak memory naive {sec['naive'].peak_extra_bytes / ours.peak_extra_bytes:.1f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashattn io", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
