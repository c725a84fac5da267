#!/usr/bin/env python3
"""Measure DRAM traffic of our kernels and of standard attention with Nsight Compute; compare with the model.

For each shape and case this runs, under `ncu --profile-from-start off`, a child process of this same script
that warms up, then brackets exactly one call with cudaProfilerStart/Stop: our forward and backward (the
launchers of flashattn.backends.triton.attention), our decode (flashattn.flash_attn_with_kvcache), the
`naive` provider's
standard attention, and SDPA's FlashAttention-2 as a yardstick. The per-kernel dram__bytes_read/write are
summed per call and set against flashattn.iomodel: the L2-aware estimate (the +-20% target) and the no-L2
upper bound. Results: ncu_io.json, ncu_io.md and the raw CSVs under --out. Each case is one process (~10-20
s); the default set is 36 cases, so on a machine with a 10-minute command limit run it in parts (--cases ours,
then naive,sdpa_flash).

On the GPU machine, from the repository root:
    PYTHONPATH=src python scripts/ncu_io.py --quick --out "$OUT"        # GPT-2 medium only, ~1 min
    PYTHONPATH=src python scripts/ncu_io.py --out "$OUT"                # every default shape
    PYTHONPATH=src python scripts/ncu_io.py --shape b=8,h=16,n=8192,d=128,causal=1 --cases ours,naive
    PYTHONPATH=src python scripts/ncu_io.py --decode-shape b=16,h=32,hk=8,sq=1,sk=16384,d=128
    PYTHONPATH=src python scripts/ncu_io.py --dry-run                   # print the ncu command lines only
Reading the counters needs profiling permission (root, or NVreg_RestrictProfilingToAdminUsers=0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from flashattn.bench.ncu import NCU_FLAGS, find_ncu, profile, profile_one  # noqa: E402

IMPLS = ("ours", "naive", "sdpa_flash")
TRAIN_SHAPES = (
    "b=64,h=16,n=1024,d=64",  # GPT-2 medium: the anchors measured naive 84.0 GB, sdpa_flash 4.41 GB (fwd+bwd)
    "b=64,h=16,n=1024,d=64,causal=1",
    "b=4,h=16,n=4096,d=128,causal=1",
    "b=1,h=16,n=16384,d=128,causal=1",
    "b=4,h=32,hk=8,n=4096,d=128",  # GQA
)
DECODE_SHAPES = ("b=16,h=32,hk=8,sq=1,sk=16384,d=128", "b=1,h=32,hk=8,sq=1,sk=65536,d=128")
TARGET = 0.20  # measured DRAM bytes within +-20% of the L2-aware estimate


# ---------------------------------------------------------------- shapes and the model

def parse_shape(spec: str) -> dict:
    """`b=64,h=16,hk=8,n=1024,sq=..,sk=..,d=64,causal=1,dtype=bf16` -> dict (n sets both sequence lengths)."""
    out: dict = {"b": 1, "h": 1, "d": 64, "causal": False, "dtype": "bf16"}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        if key == "n":
            out["sq"] = out["sk"] = int(value)
        elif key == "causal":
            out["causal"] = value.strip().lower() in ("1", "true", "yes")
        elif key == "dtype":
            out["dtype"] = value.strip()
        elif key in ("b", "h", "hk", "sq", "sk", "d"):
            out[key] = int(value)
        else:
            raise ValueError(f"shape key {key!r} in {spec!r}: expected b, h, hk, n, sq, sk, d, causal, dtype")
    if "sq" not in out:
        raise ValueError(f"shape {spec!r} needs n= or sq= (and sk=)")
    out.setdefault("sk", out["sq"])
    out.setdefault("hk", out["h"])
    return out


def attn_shape(spec: dict):
    from flashattn.iomodel import AttnShape, dtype_bytes

    return AttnShape(batch=spec["b"], nheads=spec["h"], nheads_k=spec["hk"], seqlen_q=spec["sq"],
                     seqlen_k=spec["sk"], headdim=spec["d"], dtype_bytes=dtype_bytes(spec["dtype"]),
                     causal=spec["causal"])


def model_for(spec: dict, impl: str, pass_: str):
    """The iomodel estimate a measurement is compared with (None for the SDPA yardstick)."""
    from flashattn.iomodel import backward_io, decode_io, forward_io, standard_attention

    shape = attn_shape(spec)
    if impl == "ours":
        return {"fwd": forward_io, "bwd": backward_io, "decode": decode_io}[pass_](shape)
    if impl == "naive":
        return standard_attention(shape, "fwd" if pass_ == "decode" else pass_, recipe="naive")
    return None


# ---------------------------------------------------------------- the profiled child

def _setup(spec: dict, impl: str, pass_: str):
    """(prepare, call): `call` is exactly what gets profiled; `prepare` runs before it, outside the range."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec["dtype"]]
    b, h, hk, sq, sk, d, causal = (spec[key] for key in ("b", "h", "hk", "sq", "sk", "d", "causal"))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v, dout = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d), randn(b, sq, h, d)
    scale = d**-0.5
    nothing = lambda: None  # noqa: E731
    if impl == "ours":
        if pass_ == "decode":
            # the index range checks add small kernels and a host sync to the profiled call (14 kernels where
            # 2 do the work, 2026-11-29); flash_attn has none, and the decode suite times without them too
            from flashattn import config, flash_attn_with_kvcache

            config.set_check_indices(False)
            seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
            return nothing, lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal)
        from flashattn.backends.triton.attention import attention_backward, attention_forward

        if pass_ == "fwd":
            return nothing, lambda: attention_forward(q, k, v, softmax_scale=scale, causal=causal)
        out, lse = attention_forward(q, k, v, softmax_scale=scale, causal=causal)
        return nothing, lambda: attention_backward(dout, q, k, v, out, lse, softmax_scale=scale,
                                                   causal=causal)

    # naive and SDPA take contiguous (b, h, s, d) leaves, as the benchmark providers do
    leaves = [x.transpose(1, 2).contiguous().requires_grad_(pass_ == "bwd") for x in (q, k, v)]
    dout = dout.transpose(1, 2).contiguous()
    if impl == "naive":
        from flashattn.bench.providers.naive import causal_drop_mask, naive_attention

        drop = causal_drop_mask(sq, sk, q.device) if causal else None
        fwd = lambda: naive_attention(*leaves, causal=causal, softmax_scale=scale, drop=drop)  # noqa: E731
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel(SDPBackend.FLASH_ATTENTION).__enter__()  # for the child's lifetime
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            *leaves, is_causal=causal, scale=scale, enable_gqa=h != hk)
    if pass_ in ("fwd", "decode"):
        return nothing, fwd
    state = {}
    return (lambda: state.update(out=fwd()),
            lambda: torch.autograd.grad(state["out"], leaves, dout))


def child(args: argparse.Namespace) -> int:
    try:
        prepare, call = _setup(parse_shape(args.shape), args.impl, args.pass_)
    except ImportError as err:
        print(f"ncu_io child: unavailable: {err}", file=sys.stderr)
        return 3
    for _ in range(args.warmup):  # compile, pick configs, fill the allocator's cache
        prepare()
        call()
    prepare()
    profile_one(call)
    return 0


# ---------------------------------------------------------------- the parent: run, compare, report

def build_ncu_command(ncu: str, shape: str, impl: str, pass_: str, *, warmup: int = 2,
                      python: str = sys.executable, script: str = str(Path(__file__).resolve())) -> list[str]:
    return [ncu, *NCU_FLAGS, python, script, "--child", "--shape", shape, "--impl", impl, "--pass", pass_,
            "--warmup", str(warmup)]


def cases(train_shapes, decode_shapes, impls) -> list[tuple[str, str, str]]:
    out = [(s, impl, p) for s in train_shapes for impl in impls for p in ("fwd", "bwd")]
    out += [(s, impl, "decode") for s in decode_shapes for impl in impls]
    return out


def measure(ncu: str, shape: str, impl: str, pass_: str, raw_dir: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                   os.environ.get("PYTHONPATH")])))
    started = time.time()
    result = profile(build_ncu_command(ncu, shape, impl, pass_), timeout, env=env, cwd=ROOT)
    name = f"{impl}-{pass_}-{re.sub(r'[^0-9a-z]+', '_', shape)}"
    (raw_dir / f"{name}.csv").write_text(result["stdout"])
    if result["stderr"]:
        (raw_dir / f"{name}.stderr").write_text(result["stderr"])
    if "error" in result:
        status = "unavailable" if "unavailable" in result["stderr"] else "error"
        return {status: result["error"]}
    return {"kernels": result["kernels"], "measured": result["measured"],
            "seconds": round(time.time() - started, 1)}


def compare(measured: dict, model, *, judged: bool = True) -> dict:
    """Measured/model ratios; `judged` rows (our kernels) also get the +-20% verdict."""
    if model is None:
        return {}
    total = measured["dram_read_bytes"] + measured["dram_write_bytes"]
    out = {"model": model.to_dict(), "ratio": total / model.total_bytes,
           "ratio_no_l2": total / model.total_bytes_no_l2}
    if judged:
        out["within_target"] = abs(out["ratio"] - 1) <= TARGET
    return out


def _sum_passes(results: list[dict]) -> list[dict]:
    """fwd + bwd rows per (shape, impl), measured and modelled, so training steps compare with the anchors."""
    by_key: dict[tuple[str, str], dict[str, dict]] = {}
    for r in results:
        if r["pass"] in ("fwd", "bwd") and "measured" in r:
            by_key.setdefault((r["shape"], r["impl"]), {})[r["pass"]] = r
    rows = []
    for (shape, impl), passes in by_key.items():
        if set(passes) != {"fwd", "bwd"}:
            continue
        measured = {key: passes["fwd"]["measured"][key] + passes["bwd"]["measured"][key]
                    for key in passes["fwd"]["measured"]}
        row = {"shape": shape, "impl": impl, "pass": "fwd+bwd", "measured": measured}
        models = [passes[p].get("model") for p in ("fwd", "bwd")]
        if all(models):
            model_total = sum(m["total_bytes"] for m in models)
            model_no_l2 = sum(m["total_bytes_no_l2"] for m in models)
            total = measured["dram_read_bytes"] + measured["dram_write_bytes"]
            row.update(model_total=model_total, model_no_l2=model_no_l2, ratio=total / model_total,
                       ratio_no_l2=total / model_no_l2)
            if impl == "ours":
                row["within_target"] = abs(row["ratio"] - 1) <= TARGET
        rows.append(row)
    return rows


def markdown(results: list[dict], meta: dict) -> str:
    gb = 1e9
    lines = [
        "# DRAM traffic: Nsight Compute vs flashattn.iomodel",
        "",
        f"{meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, ncu `{' '.join(meta['ncu_flags'])}`; "
        f"one call per row, summed over its kernels. Model: L2-aware estimate (target +-{TARGET:.0%}) and "
        "the no-L2 upper bound; `naive` is modelled by the standard-attention recipe, `sdpa_flash` is a "
        "yardstick.",
        "",
        "| shape | impl | pass | kernels | read GB | write GB | total GB | model GB | meas/model | no-L2 GB "
        "| meas/no-L2 | time ms | |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results + _sum_passes(results):
        if "measured" not in r:
            reason = r.get("unavailable") or r.get("error") or "?"
            lines.append(f"| {r['shape']} | {r['impl']} | {r['pass']} |" + " – |" * 9 + f" {reason} |")
            continue
        m = r["measured"]
        total = m["dram_read_bytes"] + m["dram_write_bytes"]
        model_total = r.get("model_total", r.get("model", {}).get("total_bytes"))
        model_no_l2 = r.get("model_no_l2", r.get("model", {}).get("total_bytes_no_l2"))
        cells = [
            r["shape"], r["impl"], r["pass"], str(m["kernels"]), f"{m['dram_read_bytes'] / gb:.3f}",
            f"{m['dram_write_bytes'] / gb:.3f}", f"{total / gb:.3f}",
            f"{model_total / gb:.3f}" if model_total else "–",
            f"{r['ratio']:.2f}" if "ratio" in r else "–",
            f"{model_no_l2 / gb:.3f}" if model_no_l2 else "–",
            f"{r['ratio_no_l2']:.2f}" if "ratio_no_l2" in r else "–",
            f"{m['time_ns'] / 1e6:.3f}",
            ("ok" if r["within_target"] else "off") if "within_target" in r else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _meta() -> dict:
    meta: dict = {"ncu_flags": list(NCU_FLAGS), "date": time.strftime("%Y-%m-%d")}
    try:
        import torch

        meta["torch"] = torch.__version__
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return meta


def parent(args: argparse.Namespace) -> int:
    if args.shape or args.decode_shape:
        train, decode = args.shape or [], args.decode_shape or []
    else:
        train, decode = (TRAIN_SHAPES[:1], []) if args.quick else (TRAIN_SHAPES, DECODE_SHAPES)
    todo = cases(train, decode, args.cases)
    ncu = find_ncu(args.ncu)
    if args.dry_run:
        for shape, impl, pass_ in todo:
            print(" ".join(build_ncu_command(ncu or "ncu", shape, impl, pass_)))
        return 0
    if ncu is None:
        print("ncu_io: Nsight Compute (ncu) not found; pass --ncu /path/to/ncu", file=sys.stderr)
        return 2
    default = ROOT / "benchmarks/results/io" / f"ncu-{time.strftime('%Y%m%d')}"
    out = Path(args.out or os.environ.get("OUT") or default)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    results = []
    for shape, impl, pass_ in todo:
        row = {"shape": shape, "impl": impl, "pass": pass_,
               **measure(ncu, shape, impl, pass_, raw, args.timeout)}
        if "measured" in row:
            model = model_for(parse_shape(shape), impl, pass_)
            row.update(compare(row["measured"], model, judged=impl == "ours"))
        results.append(row)
        status = next((key for key in ("error", "unavailable") if key in row), "")
        ratio = f"meas/model {row['ratio']:.2f}" if "ratio" in row else ""
        print(f"{shape:40s} {impl:10s} {pass_:6s} {status or 'ok':11s} {ratio} {row.get(status, '')}",
              flush=True)
    meta = _meta()
    (out / "ncu_io.json").write_text(json.dumps({"meta": meta, "results": results,
                                                 "fwd+bwd": _sum_passes(results)}, indent=2))
    (out / "ncu_io.md").write_text(markdown(results, meta))
    print(f"wrote {out / 'ncu_io.md'} and {out / 'ncu_io.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append",
                        help="a training shape (forward and backward are profiled): "
                        "b=..,h=..,hk=..,n=.. (or sq=,sk=),d=..,causal=0|1; repeatable")
    parser.add_argument("--decode-shape", action="append", help="a decode shape (sq=1,sk=..); repeatable. "
                        "Without --shape/--decode-shape: a default set of both")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(IMPLS),
                        help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--quick", action="store_true", help="GPT-2 medium only (the anchors' shape)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default $OUT, else "
                        "benchmarks/results/io/ncu-DATE)")
    parser.add_argument("--ncu", default=None, help="path to ncu (default: PATH, /usr/local/cuda/bin)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per profiled case")
    parser.add_argument("--dry-run", action="store_true", help="print the ncu command lines and exit")
    # the child mode ncu wraps
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "decode"), help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.shape = args.shape[0]
        return child(args)
    unknown = set(args.cases) - set(IMPLS)
    if unknown:
        parser.error(f"--cases {','.join(sorted(unknown))} not in {','.join(IMPLS)}")
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
