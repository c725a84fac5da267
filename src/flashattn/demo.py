"""`flashattn demo` and `flashattn check`: attention on this machine, checked against the fp64 oracle."""

import time

import torch

from flashattn import flash_attn_func
from flashattn.backend import backend_name
from flashattn.reference import attention_ref


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _standard_attention(q, k, v, causal: bool):
    # the paper's "standard attention": S and P materialised, softmax in fp32
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds of fn() and its peak extra memory in bytes (CUDA only, else 0)."""
    fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return sorted(times)[len(times) // 2], peak


def _rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def demo(seqlen: int | None = None, causal: bool = True) -> int:
    dev = _device()
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    b, h, d = (4, 16, 128) if cuda else (1, 4, 64)
    n = seqlen or (4096 if cuda else 1024)
    q, k, v = (torch.randn(b, n, h, d, device=dev, dtype=dtype) for _ in range(3))
    print(f"device {dev} ({torch.cuda.get_device_name() if cuda else 'CPU'}), backend {backend_name(q)}, "
          f"{dtype}, batch {b}, seqlen {n}, heads {h}, headdim {d}, causal {causal}")
    out = flash_attn_func(q, k, v, causal=causal)
    ref, _ = attention_ref(q[:1], k[:1], v[:1], causal=causal)
    ours_err = _rel_err(out[:1], ref)
    std_err = _rel_err(_standard_attention(q[:1], k[:1], v[:1], causal), ref)
    ok = ours_err <= 2 * std_err + 1e-6
    print(f"relative error vs the fp64 oracle: ours {ours_err:.2e}, standard attention {std_err:.2e} "
          f"-> {'OK' if ok else 'FAIL'}")
    repeats = 20 if cuda else 3
    t_ours, m_ours = _timed(lambda: flash_attn_func(q, k, v, causal=causal), repeats)
    try:
        t_std, m_std = _timed(lambda: _standard_attention(q, k, v, causal), repeats)
        std = f"{t_std * 1e3:8.2f} ms, peak extra memory {m_std / 2**20:8.1f} MiB"
    except torch.OutOfMemoryError:
        std = "out of memory"
    print(f"flashattn          {t_ours * 1e3:8.2f} ms, peak extra memory {m_ours / 2**20:8.1f} MiB")
    print(f"standard attention {std}")
    return 0 if ok else 1


def check() -> int:
    """Forward and gradients against the oracle over odd shapes; exit status 1 on any failure."""
    dev = _device()
    dtypes = [torch.bfloat16, torch.float16] if dev.type == "cuda" else [torch.float32]
    # (b, sq, sk, h, hk, d): odd lengths, sq != sk both ways, GQA/MQA, non-power-of-two and large head dims
    shapes = [(2, 113, 113, 4, 2, 64), (1, 17, 1023, 2, 1, 40), (1, 255, 67, 4, 4, 128),
              (2, 64, 64, 2, 2, 256)]
    failures = 0
    for dtype in dtypes:
        for b, sq, sk, h, hk, d in shapes:
            for causal in (False, True):
                q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
                k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
                v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype, requires_grad=True)
                out = flash_attn_func(q, k, v, causal=causal)
                ref, _ = attention_ref(q, k, v, causal=causal)
                pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
                dout = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), dout)
                refg = torch.autograd.grad(ref, (q, k, v), dout.double())
                ptg = torch.autograd.grad(pt, (q, k, v), dout)
                errs = [((out - ref).abs().max(), (pt - ref).abs().max(), 2)]
                for g, r, p in zip(grads, refg, ptg, strict=True):
                    errs.append(((g - r).abs().max(), (p - r).abs().max(), 3))
                ok = all(e <= f * e_pt + 1e-5 for e, e_pt, f in errs)
                failures += not ok
                verdict = 'ok  ' if ok else 'FAIL'
                print(f"{verdict} {str(dtype):15s} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} "
                      f"causal={causal}: out err {errs[0][0]:.1e} (pytorch {errs[0][1]:.1e})")
    print(f"{failures} failures")
    return 1 if failures else 0
