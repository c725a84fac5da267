"""Host time of each step of a repeated attention call, forward and backward, on the launchers' cached path
(CUDA only): what the layers of scripts/host_profile.py are made of, beside the same torch operations
(an allocation, a cast, one elementwise kernel, the autograd engine around nodes that launch nothing) as
units, SDPA-cuDNN's forward and backward, and FlashAttention-4's where its wheels came along
(scripts/host_ab.py's `_fa4`).

The problem is host_profile.py's tiny one (b=1, h=2, N=256, d=128, causal, bf16); each step runs on its own,
back to back without a sync, the median of 7 repetitions of 200 calls (host_profile.per_call_us), the steps
measured in turn within each repetition round so that drift spreads over all of them.

    python scripts/host_steps.py OUT.json [PROFILE.txt]

"bwd public no threads stubbed" runs the public backward with the backward op's implementation replaced by
one that returns gradients computed beforehand: its time is the autograd engine and the Python between it
and the op.
PROFILE.txt: cProfile's listing (by own time) of 300 calls of the public forward and of the public backward
(no device threads), each apart.
"""

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from host_ab import _fa4  # this script's folder is on sys.path
from host_profile import per_call_us
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func
from flashattn.backends.triton import attention, gluon
from flashattn.ops import attention as ops


class _Pass(torch.autograd.Function):
    """A node of three inputs whose backward launches nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad, grad


def _steps():
    d, causal, scale = 128, True, 128 ** -0.5
    q, k, v = (torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=causal)
    o = out.detach()
    lse = attention.attention_forward(q, k, v, softmax_scale=scale, causal=causal)[1]
    rng = torch.zeros(2, dtype=torch.int64)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    window = (-1, -1)

    def fwd_key():
        attention._cacheable(qd, (qd, kd, vd), scale, window)
        return attention._forward_cache.get(attention._forward_signature(
            qd, kd, vd, scale, causal, window, 0.0, None, 0.0, 0, 0, None, None, None, None, None))

    fwd_hit = fwd_key()
    pb, route, out_shape, lse_shape, prepared = fwd_hit
    fo = torch.empty(*out_shape, dtype=q.dtype, device=q.device)
    fl = torch.empty(*lse_shape, dtype=torch.float32, device=q.device)

    def bwd_key():
        attention._cacheable(qd, (qd, kd, vd, do), scale, window)
        return attention._backward_cache.get(attention._backward_signature(
            do, qd, kd, vd, o, lse, scale, causal, window, 0.0, None, 0.0, 0, 0, None, None, None, None, None,
            None, None))

    attention.attention_backward(do, qd, kd, vd, o, lse, softmax_scale=scale, causal=causal)
    bpb, broute, preprocess, pre_args, bprepared = bwd_key()
    dk, dv = torch.empty_like(kd), torch.empty_like(vd)
    stats, dq_acc = gluon.backward_buffers(bpb, qd)

    def bwd_allocs():
        torch.empty(*k.shape, dtype=k.dtype, device=k.device)
        torch.empty(*v.shape, dtype=v.dtype, device=v.device)
        gluon.backward_buffers(bpb, qd)

    def bwd_main():  # gluon.backward's launch alone: no ALiBi, varlen, group split, sink or lock
        bprepared((qd, do, kd, vd, dk, dv, dq_acc, stats),
                  (*bprepared.args, *(None,) * 17, 0, 0, *gluon.sparse_backward_args(None)))

    def grad(threads, output=out, inputs=(q, k, v)):
        def run():
            with torch.autograd.set_multithreading_enabled(threads):
                torch.autograd.grad(output, inputs, do, retain_graph=True)
        return run

    # the engine's own cost around a node that launches nothing: a Python node like ours (three inputs)
    # and a C++ one (a view's), each on the calling thread and on the device threads
    passed = _Pass.apply(q, k, v)
    viewed = q.view(q.shape)

    def step(threads, forward, inputs, grad_out):  # a training step's attention: forward, then backward
        def run():
            with torch.autograd.set_multithreading_enabled(threads):
                torch.autograd.grad(forward(), inputs, grad_out)
        return run

    qt, kt, vt, dot = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v, do))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    cudnn_out = cudnn()

    def cudnn_grad(threads):
        def run():
            with torch.autograd.set_multithreading_enabled(threads):
                torch.autograd.grad(cudnn_out, (qt, kt, vt), dot, retain_graph=True)
        return run

    x = torch.randn(256, 2, d, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    fa4 = _fa4()
    fa4_steps = {}
    if fa4 is not None:
        def fa4_fwd():
            return fa4.flash_attn_func(q, k, v, causal=causal)[0]
        fa4_out = fa4_fwd()
        fa4_steps = {"fa4 fwd": fa4_fwd, "fa4 bwd threads": grad(True, fa4_out),
                     "fa4 bwd no threads": grad(False, fa4_out),
                     "fa4 fwd+bwd threads": step(True, fa4_fwd, (q, k, v), do),
                     "fa4 fwd+bwd no threads": step(False, fa4_fwd, (q, k, v), do)}
    bwd_impl = ops.attn_bwd.impl
    bwd_done = bwd_impl(do, qd, kd, vd, o, lse, rng, None, None, 256, 256, scale, causal, -1, -1, 0.0, None,
                        0.0, None, False)

    def stubbed(fn):
        # the backward op's implementation returns the gradients computed above (fresh ones would add only
        # their allocations: "bwd allocs"); inside the backward (grad mode off) the Op calls Op.impl
        def run():
            ops.attn_bwd.impl = lambda *a: bwd_done
            try:
                fn()
            finally:
                ops.attn_bwd.impl = bwd_impl
        return run

    return {
        **fa4_steps,
        "cudnn fwd": cudnn,
        "cudnn bwd threads": cudnn_grad(True),
        "cudnn bwd no threads": cudnn_grad(False),
        "cudnn fwd+bwd threads": step(True, cudnn, (qt, kt, vt), dot),
        "cudnn fwd+bwd no threads": step(False, cudnn, (qt, kt, vt), dot),
        "fwd+bwd public threads": step(True, lambda: flash_attn_func(q, k, v, causal=causal), (q, k, v), do),
        "fwd+bwd public no threads": step(False, lambda: flash_attn_func(q, k, v, causal=causal), (q, k, v),
                                          do),
        "unit torch.empty": lambda: torch.empty(256, 2, d, dtype=torch.bfloat16, device="cuda"),
        "unit float->bf16 .to": lambda: xf.to(torch.bfloat16),
        "unit x * 2": lambda: x * 2,
        "unit python node bwd threads": grad(True, passed),
        "unit python node bwd no threads": grad(False, passed),
        "unit c++ view node bwd threads": grad(True, viewed, (q,)),
        "unit c++ view node bwd no threads": grad(False, viewed, (q,)),
        "fwd public": lambda: flash_attn_func(q, k, v, causal=causal),
        "fwd public nograd": lambda: flash_attn_func(qd, kd, vd, causal=causal),
        "fwd op impl": lambda: ops._fwd_impl(qd, kd, vd, None, None, 256, 256, scale, causal, -1, -1, 0.0,
                                             None, 0.0, None, False),
        "fwd launcher": lambda: attention.attention_forward(qd, kd, vd, softmax_scale=scale, causal=causal),
        "fwd key+lookup": fwd_key,
        "fwd allocs": lambda: (torch.empty(*out_shape, dtype=q.dtype, device=q.device),
                               torch.empty(*lse_shape, dtype=torch.float32, device=q.device)),
        "fwd gluon.forward": lambda: gluon.forward(pb, route, qd, kd, vd, fo, fl, prepared),
        "bwd public threads": grad(True),
        "bwd public no threads": grad(False),
        "bwd public no threads stubbed": stubbed(grad(False)),
        "bwd op impl": lambda: ops._bwd_impl(do, qd, kd, vd, o, lse, rng, None, None, 256, 256, scale, causal,
                                             -1, -1, 0.0, None, 0.0, None, False),
        "bwd launcher": lambda: attention.attention_backward(do, qd, kd, vd, o, lse, softmax_scale=scale,
                                                             causal=causal),
        "bwd key+lookup": bwd_key,
        "bwd allocs": bwd_allocs,
        "bwd preprocess": lambda: preprocess((o, do, stats[1], qd, dq_acc, lse, stats[0], None, *pre_args)),
        "bwd main launch": bwd_main,
        "bwd gluon.backward": lambda: gluon.backward(bpb, broute, qd, kd, vd, do, stats, dq_acc, dk, dv,
                                                     scale, bprepared),
        "bwd dq .to": lambda: dq_acc.to(q.dtype),
    }


def _profile(steps, path):
    with open(path, "w") as f:
        for name in ("fwd public", "bwd public no threads"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                steps[name]()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            f.write(f"== {name}: 300 calls\n{text.getvalue()}\n")


def main(path, profile_path=None):
    steps = _steps()
    for fn in steps.values():  # compiled and cached before timing
        fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in steps}
    t0 = time.perf_counter()
    for _ in range(7):
        for name, fn in steps.items():
            samples[name].append(per_call_us(fn, reps=1))
    results = {name: statistics.median(s) for name, s in samples.items()}
    for name, us in results.items():
        print(f"{name:28} {us:7.1f} us/call", flush=True)
    print(f"({time.perf_counter() - t0:.1f} s)")
    with open(path, "w") as f:
        json.dump({"us_per_call": results, "device": torch.cuda.get_device_name()}, f, indent=1)
    if profile_path:
        _profile(steps, profile_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
