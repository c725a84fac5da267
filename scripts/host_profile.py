"""Where the host time of one attention call goes, layer by layer (CUDA only).

A tiny problem (b=1, h=2, N=256), so the GPU never holds the host back: each number is the wall time per
call of back-to-back calls without a sync, the median of 7 repetitions of 200 calls. Layers, outermost first:
  public   flash_attn_func with inputs that require grad (what training and the bench call)
  nograd   the same under torch.no_grad (the autograd Function's share is the difference)
  launcher backends.triton.attention.attention_forward / attention_backward (argument checks and autograd
           excluded)
  jit      the kernel's launch through the JIT (kernel[grid](...)) with every argument built beforehand
  compiled the compiled kernel's run() with the same arguments (the JIT's binding and cache lookup excluded:
           what backends/triton/launch.py's plans do)
and sdpa-cudnn's public call beside them; then the public calls again at the train grid's d=128 N=1K causal
size (b=16, h=16; 20 calls a repetition, which the GPU queue absorbs): host time that grows with the problem
(through allocations, say) shows there. Then a cProfile of forward + backward through the public API.

    python scripts/host_profile.py OUT.json
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
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func
from flashattn.backends.triton import attention, launch


def per_call_us(fn, calls=200, reps=7):
    """Wall time per call of back-to-back calls without a sync, the median of reps repetitions."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


class _Capture:
    """Records the arguments of the next launch of a JIT function, and the compiled kernel it returns."""

    def __init__(self, jit_fn):
        self.jit_fn, self.calls = jit_fn, []

    def __enter__(self):
        original = self.jit_fn.run

        def run(*args, grid, warmup, **kwargs):
            kernel = original(*args, grid=grid, warmup=warmup, **kwargs)
            self.calls.append((args, kwargs, grid, kernel))
            return kernel
        self.jit_fn.run = run
        return self

    def __exit__(self, *exc):
        del self.jit_fn.run


def _launches(jit_fn, call):
    """(jit launch, compiled launch) closures replaying the last launch of jit_fn made by call()."""
    # a launch plan would bypass the JIT's run(), which the capture hooks; so would the plans the Gluon
    # launchers keep per call signature
    launch._plans.clear()
    attention._forward_cache.clear()
    attention._backward_cache.clear()
    with _Capture(jit_fn) as cap:
        call()
    args, kwargs, grid, kernel = cap.calls[-1]
    names = jit_fn.arg_names
    values = list(args) + [kwargs[n] for n in names[len(args):]]  # every parameter, constexprs included
    options = {k: v for k, v in kwargs.items() if k not in names}
    stream = torch.cuda.current_stream().cuda_stream
    g = tuple(grid) + (1,) * (3 - len(grid))

    def jit():
        jit_fn[grid](*args, **{n: kwargs[n] for n in names[len(args):]}, **options)

    def compiled():
        kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)
    return jit, compiled


def _layers(d, causal):
    """name -> closure, for the layers of the module docstring at head dim d."""
    from flashattn.kernels.gluon.attn_bwd import attn_bwd_ws_kernel
    from flashattn.kernels.gluon.attn_fwd import attn_fwd_ws_kernel

    q, k, v = (torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    scale = d ** -0.5
    out = flash_attn_func(q, k, v, causal=causal)
    lse = attention.attention_forward(q, k, v, softmax_scale=scale, causal=causal)[1]
    try:
        fwd_jit, fwd_compiled = _launches(attn_fwd_ws_kernel, lambda: attention.attention_forward(
            q, k, v, softmax_scale=scale, causal=causal))
        bwd_jit, bwd_compiled = _launches(attn_bwd_ws_kernel, lambda: attention.attention_backward(
            do, q, k, v, out.detach(), lse, softmax_scale=scale, causal=causal))
    except Exception as exc:  # noqa: BLE001 - the public layers still count
        print(f"capturing the launches failed: {type(exc).__name__}: {exc}", flush=True)
        fwd_jit = fwd_compiled = bwd_jit = bwd_compiled = None
    qt, kt, vt, dot = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, do))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    cudnn_out = cudnn()

    def nograd():
        with torch.no_grad():
            flash_attn_func(q, k, v, causal=causal)
    layers = {
        "fwd public": lambda: flash_attn_func(q, k, v, causal=causal),
        "fwd nograd": nograd,
        "fwd launcher": lambda: attention.attention_forward(q, k, v, softmax_scale=scale, causal=causal),
        "fwd jit": fwd_jit,
        "fwd compiled": fwd_compiled,
        "fwd cudnn": cudnn,
        "bwd public": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
        "bwd launcher": lambda: attention.attention_backward(
            do, q, k, v, out.detach(), lse, softmax_scale=scale, causal=causal),
        "bwd jit": bwd_jit,
        "bwd compiled": bwd_compiled,
        "bwd cudnn": lambda: torch.autograd.grad(cudnn_out, (qt, kt, vt), dot, retain_graph=True),
    }
    return {name: fn for name, fn in layers.items() if fn is not None}


def _train_size_layers():
    """The public calls, ours and cuDNN's, at the train grid's d=128 N=1K causal shape."""
    q, k, v = (torch.randn(16, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    qt, kt, vt, dot = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, do))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    cudnn_out = cudnn()
    return {
        "fwd public": lambda: flash_attn_func(q, k, v, causal=True),
        "fwd cudnn": cudnn,
        "bwd public": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
        "bwd cudnn": lambda: torch.autograd.grad(cudnn_out, (qt, kt, vt), dot, retain_graph=True),
    }


def main(path):
    torch.manual_seed(0)
    results = {}
    cases = [(f"d={d:3} causal={causal!s:5}", lambda d=d, causal=causal: _layers(d, causal))
             for d, causal in ((128, True), (64, False))]
    cases.append(("b=16 N=1K d=128 causal", _train_size_layers))
    for label, layers in cases:
        for name, fn in layers().items():
            try:
                us = per_call_us(fn, calls=20 if label.startswith("b=16") else 200)
            except Exception as exc:  # noqa: BLE001 - one broken layer must not lose the others
                print(f"{label} {name}: {type(exc).__name__}: {exc}", flush=True)
                continue
            results[f"{label} {name}"] = us
            print(f"{label} {name:13} {us:7.1f} us/call", flush=True)

    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    for _ in range(5):
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    print(text.getvalue())
    with open(path, "w") as f:
        json.dump({"us_per_call": results, "cprofile": text.getvalue()}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
