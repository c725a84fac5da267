"""The Gluon backward's variants beside FlashAttention-2 (the M1 bar is 1.4x it) and cuDNN, H200 only.

Times the backward alone (torch.autograd.grad of one forward, as `flashattn bench --modes bwd`) in one
process: the shipped choice and variants of it, each checked against the shipped gradients first; do_bench
medians.

    python scripts/bwd_sweep.py OUT.json [HEAD_DIM ...]    # default: 128

BWD_SWEEP_SHAPES="1,16384,1;4,4096,1" narrows the shapes (batch, N, causal); BWD_SWEEP_GROUPS="1,4,all" adds
the launch order with that many heads per group of grouped_program's order (`all`: every head in one group,
the heaviest key tile of every head first); BWD_SWEEP_EXTRA='{"name": {"VAR": "value"}}' adds variants under
other switches; BWD_SWEEP_KERNEL=FILE adds the backward with FILE's attn_bwd_ws_kernel in place of the
package's (an A/B against an earlier or a trial kernel in one process); BWD_SWEEP_REPEAT=R times every variant
R times, interleaved (drift shows as the spread between rounds).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from sweep_rows import kernel_from_file, record, shapes
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashattn import flash_attn_func
from flashattn.kernels import attn_bwd_ws
from flashattn.ops import attention

# (batch, N, causal) at 16K tokens, hidden 2048: M1's marginal backward point (d=128 16K causal) and the
# causal rows furthest from cuDNN, with the non-causal 16K row for the steady state
SHAPES = shapes("BWD_SWEEP_SHAPES", [(1, 16384, True), (1, 16384, False), (4, 4096, True), (16, 1024, True)])
VARIANTS = {"shipped": {}}  # name -> environment (BWD_SWEEP_* entries are read by _run_variant)
for _g in filter(None, os.environ.get("BWD_SWEEP_GROUPS", "").split(",")):
    VARIANTS[f"group {_g}"] = {"BWD_SWEEP_GROUP": _g}
VARIANTS.update(json.loads(os.environ.get("BWD_SWEEP_EXTRA", "{}")))
_SHIPPED_KERNEL = attn_bwd_ws.attn_bwd_ws_kernel
_OTHER_KERNEL = None
if os.environ.get("BWD_SWEEP_KERNEL"):
    _OTHER_KERNEL = kernel_from_file(os.environ["BWD_SWEEP_KERNEL"], "attn_bwd_ws_kernel")
    VARIANTS["BWD_SWEEP_KERNEL"] = {"BWD_SWEEP_OTHER": "1"}
_REPEAT = int(os.environ.get("BWD_SWEEP_REPEAT", "1"))
_ENV_NAMES = {name for env in VARIANTS.values() for name in env}  # cleared before each variant
_lpt_group = attention._Problem.lpt_group


def _run_variant(env, fn):
    for name in _ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(env)
    group = env.get("BWD_SWEEP_GROUP")
    if group is not None:
        attention._Problem.lpt_group = lambda self, n_bh, stream_bytes: n_bh if group == "all" else int(group)
    if env.get("BWD_SWEEP_OTHER") == "1":
        attn_bwd_ws.attn_bwd_ws_kernel = _OTHER_KERNEL
    # the launchers' per-signature caches hold the kernel and the order of the call that filled them
    attention._backward_cache.clear()
    try:
        return fn()
    finally:
        attention._Problem.lpt_group = _lpt_group
        attn_bwd_ws.attn_bwd_ws_kernel = _SHIPPED_KERNEL
        attention._backward_cache.clear()


def _median_ms(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _shape(d, b, n, causal, rows, path):
    q, k, v = (torch.randn(b, n, 2048 // d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    # FlashAttention's convention: the backward is 2.5x the forward's 4 b h N^2 d, halved under causal masking
    flops = 2.5 * 4 * b * 2048 * n * n / (2 if causal else 1)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)

    def grads():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    ref = _run_variant({}, grads)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))

    def sdpa_bwd(backend):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        do = dout.transpose(1, 2)
        return lambda: torch.autograd.grad(o, (qt, kt, vt), do, retain_graph=True)

    bar = 1.4 * flops / _median_ms(sdpa_bwd(SDPBackend.FLASH_ATTENTION)) * 1e-9
    cudnn = flops / _median_ms(sdpa_bwd(SDPBackend.CUDNN_ATTENTION)) * 1e-9
    print(f"d={d} N={n} causal={causal}: 1.4 x FA2 = {bar:.0f} TFLOP/s, cuDNN {cudnn:.0f}", flush=True)
    for rnd, (name, env) in ((r, v) for r in range(_REPEAT) for v in VARIANTS.items()):

        def measure(row, env=env):
            got = _run_variant(env, grads)
            torch.cuda.synchronize()
            row["rel_err"] = max(((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                                 for g, r in zip(got, ref, strict=True))
            ms = _run_variant(env, lambda: _median_ms(grads))
            row.update(ms=ms, tflops=flops / ms * 1e-9)

        record(rows, path, dict(d=d, n=n, causal=causal, variant=name, round=rnd, bar_tflops=bar,
                                cudnn_tflops=cudnn), measure,
               lambda row: f"{row['tflops']:5.0f} TFLOP/s ({row['tflops'] / bar:.3f} of the bar, "
                           f"{row['tflops'] / cudnn:.3f} of cuDNN), rel err {row['rel_err']:.1e}")


def main(path, head_dims):
    rows = []
    for d in head_dims:
        for b, n, causal in SHAPES:
            _shape(d, b, n, causal, rows, path)


if __name__ == "__main__":
    main(sys.argv[1], [int(d) for d in sys.argv[2:]] or [128])
