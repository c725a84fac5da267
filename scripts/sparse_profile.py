"""Where the block-sparse forward+backward time goes: per-kernel GPU time (torch.profiler) beside the bench's
do_bench time of the same call, for ours (rule and bitmask paths) and flex, on the sparse suite's masks.

A do_bench time well above the kernels' sum means bubbles (host time, syncs) rather than slow kernels.

    python scripts/sparse_profile.py --out sparse_profile.json [--seqlen 16384]
"""

import argparse
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flashattn
from flashattn.bench.providers.flex import _compiled_flex
from flashattn.bench.providers.sparse import MaskSpec, block_mask, flex_block_mask
from flashattn.bench.suites.sparse import local_global_params

CASES = [("random", 0.05), ("random", 0.1), ("local_global", 0.05), ("local_global", 0.1)]


def _kernel_times(fn, iters=5):
    """{kernel name: GPU µs per call} over `iters` calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.self_device_time_total > 0:
            out[evt.key[:60]] = round(evt.self_device_time_total / iters, 1)
    return out


def _sync_free(fn):
    """None when a warm call never synchronizes the host with the GPU, else the error that says where."""
    fn()  # warm: the first call compiles
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as exc:
        return str(exc)[:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _calls(q, k, v, dout, mask, fmask):
    """fwd+bwd of ours and of flex on the same inputs (flex in its (b, h, s, d) layout)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    hleaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    hdout = dout.transpose(1, 2).contiguous()
    flex = _compiled_flex()
    return {
        "ours": lambda: torch.autograd.grad(flashattn.block_sparse_attn_func(*leaves, mask), leaves, dout),
        "flex": lambda: torch.autograd.grad(flex(*hleaves, block_mask=fmask), hleaves, hdout),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=16384)
    args = ap.parse_args()
    n, h, d = args.seqlen, 16, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    rows = []
    for pattern, density in CASES:
        window, glob = local_global_params(n, density) if pattern == "local_global" else (-1, 0)
        spec = MaskSpec(pattern, n, h, window, glob, density)
        mask = block_mask(spec, q.device)
        for name, fn in _calls(q, k, v, dout, mask, flex_block_mask(spec, q.device)).items():
            for rule in ("1", "0") if name == "ours" else ("1",):
                os.environ["FLASHATTN_SPARSE_RULE"] = rule
                kernels = _kernel_times(fn)
                syncs = _sync_free(fn)
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row = dict(pattern=pattern, density=density, density_real=round(mask.density(), 4),
                           provider=name if rule == "1" else "ours-bits", do_bench_ms=round(ms, 4),
                           kernels_ms=round(sum(kernels.values()) / 1e3, 4), kernels_us=kernels,
                           host_sync=syncs)
                print(json.dumps(row), flush=True)
                rows.append(row)
        os.environ["FLASHATTN_SPARSE_RULE"] = "1"
    dense = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    rows.append(dict(provider="ours-dense", host_sync=_sync_free(
        lambda: torch.autograd.grad(flashattn.flash_attn_func(*dense, causal=True), dense, dout))))
    print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
