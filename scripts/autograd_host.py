"""Host time of the autograd engine around one backward node (CUDA only): what a backward call costs above
its own work, for a C++ op, a Python autograd.Function (trivial, and launching one kernel), our attention
and SDPA-cuDNN's, with the engine's device threads on (PyTorch's default) and off
(torch.autograd.set_multithreading_enabled(False): the backward runs on the calling thread).

    python scripts/autograd_host.py OUT.json
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from host_profile import per_call_us  # this script's folder is on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


class _OneKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _LikeOurs(torch.autograd.Function):
    """Our node's shape: three inputs in, three outputs (two not differentiable), seven tensors saved, one
    kernel a gradient in the backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse, rng = q * 2, q.new_empty(1, dtype=torch.float32), q.new_empty(2, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, out, lse, rng, None)
        ctx.mark_non_differentiable(lse, rng)
        ctx.set_materialize_grads(False)
        return out, lse, rng

    @staticmethod
    def backward(ctx, g, glse, grng):
        q, k, v, out, lse, rng, _ = ctx.saved_tensors
        return g * 2, g * 3, g * 4


def main(path):
    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt, dot = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, do))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    outs = {"c++ mul": q * 2, "python identity": _Identity.apply(q), "python one kernel": _OneKernel.apply(q),
            "flashattn": flash_attn_func(q, k, v, causal=True)}
    results = {}
    from flashattn.backends.triton import attention
    from flashattn.ops import attention as ops

    out = outs["flashattn"]
    lse = attention.attention_forward(q, k, v, softmax_scale=128 ** -0.5, causal=True)[1]
    rng = torch.zeros(2, dtype=torch.int64)
    outs["python like ours"] = _LikeOurs.apply(q, k, v)[0]
    results["flashattn launcher"] = per_call_us(lambda: attention.attention_backward(
        do, q, k, v, out.detach(), lse, softmax_scale=128 ** -0.5, causal=True))
    results["flashattn op"] = per_call_us(lambda: ops.attn_bwd(
        do, q, k, v, out.detach(), lse, rng, None, None, 256, 256, 128 ** -0.5, True, -1, -1, 0.0, None, 0.0,
        None, False))
    # our backward op's own time inside the engine (on its device thread, or on the calling one)
    impl, inside = ops.attn_bwd.impl, []

    def timed(*args):
        t0 = time.perf_counter()
        result = impl(*args)
        inside.append(time.perf_counter() - t0)
        return result

    ops.attn_bwd.impl = timed
    for threads in (True, False):
        with torch.autograd.set_multithreading_enabled(threads):
            for name, out in outs.items():
                inputs = (q, k, v) if name in ("flashattn", "python like ours") else (q,)
                inside.clear()
                results[f"{name} threads={threads}"] = per_call_us(
                    lambda out=out, inputs=inputs: torch.autograd.grad(out, inputs, do, retain_graph=True))
                if inside:
                    results[f"{name} threads={threads}: its op inside"] = statistics.median(inside) * 1e6
            results[f"cudnn threads={threads}"] = per_call_us(
                lambda: torch.autograd.grad(cudnn_out, (qt, kt, vt), dot, retain_graph=True))
    for name, us in results.items():
        print(f"{name:32} {us:7.1f} us/call", flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
