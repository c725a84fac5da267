"""`flashattn demo` and `flashattn check`: attention on this machine, checked against the fp64 oracle."""

import time

import torch

from flashattn import flash_attn_func
from flashattn.backends import backend_name
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
    failures += _check_decode(dev, dtypes) + _check_block_sparse(dev, dtypes) + _check_fp8(dev)
    print(f"{failures} failures")
    return 1 if failures else 0


def _verdict(name: str, out, ref, pt) -> int:
    err, err_pt = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
    ok = err <= 2 * err_pt + 1e-5
    print(f"{'ok  ' if ok else 'FAIL'} {name}: out err {err:.1e} (pytorch {err_pt:.1e})")
    return int(not ok)


def _check_decode(dev: torch.device, dtypes) -> int:
    """flash_attn_with_kvcache on a shuffled paged cache (pages of 16), GQA 4, ragged lengths, split-KV."""
    from flashattn import flash_attn_with_kvcache

    failures = 0
    for dtype in dtypes:
        b, cap, page, h, hk, d = 3, 320, 16, 8, 2, 64
        k, v = (torch.randn(b, cap, hk, d, device=dev, dtype=dtype) for _ in range(2))
        perm = torch.randperm(b * cap // page, device=dev)
        k_pool, v_pool = torch.empty_like(k).view(-1, page, hk, d), torch.empty_like(v).view(-1, page, hk, d)
        k_pool[perm], v_pool[perm] = k.reshape(-1, page, hk, d), v.reshape(-1, page, hk, d)
        table = perm.view(b, -1).to(torch.int32)
        lens = [1, 200, cap]
        q = torch.randn(b, 1, h, d, device=dev, dtype=dtype)
        out = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=torch.tensor(lens, device=dev,
                                      dtype=torch.int32), block_table=table, num_splits=4)
        for i, n in enumerate(lens):
            args = (q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n])
            ref, pt = attention_ref(*args)[0], attention_ref(*args, upcast=False)[0]
            failures += _verdict(f"{str(dtype):15s} decode paged page={page} kv_len={n} h={h} hk={hk} d={d}",
                                 out[i : i + 1], ref, pt)
    return failures


def _check_block_sparse(dev: torch.device, dtypes) -> int:
    """block_sparse_attn_func with the local + global mask, odd length, GQA: forward against the dense-mask
    oracle."""
    from flashattn import BlockMask, block_sparse_attn_func
    from flashattn.reference import masked_attention_ref

    failures = 0
    n, h, hk, d = 333, 4, 2, 64
    mask = BlockMask.local_global(n, 70, 16, block_size=(64, 64), device=dev)
    dense = mask.to_dense()
    for dtype in dtypes:
        q, k, v = (torch.randn(1, n, heads, d, device=dev, dtype=dtype) for heads in (h, hk, hk))
        out = block_sparse_attn_func(q, k, v, mask)
        ref = masked_attention_ref(q, k, v, dense)[0]
        pt = masked_attention_ref(q, k, v, dense, upcast=False)[0]
        name = f"{str(dtype):15s} block-sparse local_global n={n} h={h} hk={hk} d={d}"
        failures += _verdict(name, out, ref, pt)
    return failures


def _check_fp8(dev: torch.device) -> int:
    """The FP8 forward (e4m3, per-head descales, GQA, odd lengths) against the oracle on its dequantised
    inputs, within twice plain PyTorch's error at FP8's precision (attention_ref_fp8) plus 1e-3."""
    from flashattn import fp8
    from flashattn.reference import attention_ref_fp8

    failures = 0
    out_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for causal in (False, True):
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(torch.randn(1, n, heads, 64, device=dev), "head")
                                        for n, heads in ((113, 4), (300, 2), (300, 2)))
        with torch.no_grad():
            out = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                  out_dtype=out_dtype)
        ref = attention_ref_fp8(q8, k8, v8, qd, kd, vd, causal=causal)[0]
        pt = attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=False, out_dtype=out_dtype, causal=causal)[0]
        err, err_pt = (out.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
        ok = err <= 2 * err_pt + 1e-3
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} fp8 e4m3 sq=113 sk=300 h=4 hk=2 d=64 causal={causal}: out err "
              f"{err:.1e} (pytorch at fp8 {err_pt:.1e})")
    return failures
