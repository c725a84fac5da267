"""Random valid calls of the FP8 forward (dense and varlen, every descale granularity), against
attention_ref_fp8 under the FP8 tolerance of tests/test_interface_fp8.py (tests/fuzz_cases.py's Call and
Draw)."""

from __future__ import annotations

import torch
from fuzz_cases import Call, Draw, _heads, _tensor

import flashattn
from flashattn import fp8
from flashattn.reference import attention_ref_fp8

# ------------------------------------------------------------------------------------------ FP8 forward

FP8_FLOOR = 1e-3  # tests/test_interface_fp8.py: the output's own rounding; the LSE's is 1e-4


def _quantized(x, granularity, hk, seq_contiguous=False):
    """fp8.quantize(x, granularity), granularity "kv-head" too: q (b, s, h, d) with one descale per (batch,
    kv head) (FlashAttention-3's shape), quantised as (b, s, hk, h / hk * d)."""
    if granularity != "kv-head":
        return fp8.quantize(x, granularity, seq_contiguous=seq_contiguous)
    b, s, h, d = x.shape
    x8, descale = fp8.quantize(x.reshape(b, s, hk, (h // hk) * d), "head")
    return x8.view(b, s, h, d), descale


def _fp8_values(gen, b, s, heads, dim, sign, device):
    """Random values, each (batch, head) in a binade of its own (quantize's descales are powers of two: a
    descale read for the wrong head shows); q's shrink as k's grow (sign), so scores stay of order one."""
    binade = 2.0 ** (sign * torch.randint(0, 4, (b, 1, heads, 1), generator=gen).float())
    return (torch.randn(b, s, heads, dim, generator=gen) * binade).to(device)


def _check_fp8(out, lse, q8, k8, v8, qd, kd, vd, out_dtype, opts):
    from utils import assert_close_to_ref

    ref, ref_lse = attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=True, **opts)
    pt, pt_lse = attention_ref_fp8(q8, k8, v8, qd, kd, vd, upcast=False, out_dtype=out_dtype, **opts)
    assert out.dtype == out_dtype, f"out dtype {out.dtype}, expected {out_dtype}"
    assert_close_to_ref(out, ref, pt, atol_floor=FP8_FLOOR)
    assert_close_to_ref(lse, ref_lse, pt_lse, atol_floor=1e-4, name="lse")


def fp8_call(d: Draw, env) -> Call:
    """flash_attn_func / flash_attn_varlen_func on e4m3 q, k, v with descales (one left out: 1), against
    attention_ref_fp8 under the FP8 tolerance of tests/test_interface_fp8.py. out_dtype among env.dtypes:
    the interpreter's are fp16 / fp32 (it rounds to bf16 wrongly)."""
    varlen = d.chance(0.35)
    batch = d.int(1, 3) if varlen else d.int(1, 2)
    h, hk = _heads(d, env, 1 if varlen else batch)
    hd = d.pick([16, 32, 40])
    dv = hd if d.chance(0.8) else d.pick([16, 32])
    out_dtype = d.pick(env.dtypes)
    opts = {"causal": d.chance(0.5)}
    if d.chance(0.25):
        opts["window_size"] = (d.pick([-1, 0, 4, 19]), d.pick([-1, 0, 5]))
    if d.chance(0.15):
        opts["softcap"] = d.pick([0.5, 4.0])
    if d.chance(0.15):
        opts["alibi_slopes"] = _tensor(d, (h,), torch.float32, env.device).abs() * 0.3
    if d.chance(0.15):
        opts["learnable_sink"] = _tensor(d, (h,), torch.float32, env.device)
    if d.chance(0.1):
        opts["softmax_scale"] = d.pick([0.05, 0.3])
    gen = d.generator()
    grans = (d.pick(["tensor", "head", "kv-head"]), d.pick(fp8.GRANULARITIES), d.pick(fp8.GRANULARITIES))
    v_seq_contiguous = d.chance(0.3)
    omit = d.pick([None] * 8 + [0, 1, 2])  # a descale left out means 1
    if not varlen:
        sq, sk = d.length(env), d.length(env)
        q8, k8, v8, qd, kd, vd = _fp8_dense(gen, env, batch, (sq, sk), (h, hk), (hd, dv), grans,
                                            v_seq_contiguous)
        cu_q = cu_k = None
    else:
        lens_q = [d.length(env, zero=0.15) for _ in range(batch)]
        lens_k = [d.length(env, zero=0.1) for _ in range(batch)]
        extra = d.pick([0, 0, 3])  # rows past the last sequence (unspecified)
        q8, k8, v8, qd, kd, vd = _fp8_varlen(gen, env, (lens_q, lens_k), extra, (h, hk), (hd, dv), grans,
                                             v_seq_contiguous and d.chance(0.5))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n, dtype=torch.int64).cumsum(0).tolist()],
                                   dtype=torch.int32, device=env.device) for n in (lens_q, lens_k))
        mq, mk = max(lens_q), max(lens_k)
    tensors, descales = [q8, k8, v8], [qd, kd, vd]
    if omit is not None and descales[omit].numel() == 1:  # that tensor's values taken as they are (x · 1)
        tensors[omit] = (tensors[omit].float() * descales[omit]).to(fp8.FP8)
        descales[omit] = torch.ones(1, device=env.device)
    else:
        omit = None
    q8, k8, v8 = tensors
    given = {f"{n}_descale": None if i == omit else x for i, (n, x) in enumerate(zip("qkv", descales,
                                                                                   strict=True))}

    def run():
        if cu_q is None:
            return flashattn.flash_attn_func(q8, k8, v8, return_attn_probs=True, out_dtype=out_dtype, **given,
                                             **opts)
        return flashattn.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, return_attn_probs=True,
                                                out_dtype=out_dtype, **given, **opts)

    def check(res):
        out, lse, s = res
        assert s.numel() == 0, "S_dmask of an FP8 call: empty"
        assert out.shape == (*q8.shape[:-1], dv), f"out shape {tuple(out.shape)}"
        if cu_q is None:
            _check_fp8(out, lse, q8, k8, v8, *descales, out_dtype, opts)
            return
        for i in range(batch):
            rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            ds = [x if x.numel() == 1 else x[i : i + 1] for x in descales]
            _check_fp8(out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0), q8[rq].unsqueeze(0),
                       k8[rk].unsqueeze(0), v8[rk].unsqueeze(0), *ds, out_dtype, opts)

    return Call(f"fp8-{'varlen' if varlen else 'dense'}", run, check)


def _fp8_dense(gen, env, b, lens, heads, dims, grans, v_seq_contiguous):
    (sq, sk), (h, hk), (hd, dv) = lens, heads, dims
    q, k, v = (_fp8_values(gen, b, s, n, dim, sign, env.device)
               for s, n, dim, sign in ((sq, h, hd, -1), (sk, hk, hd, 1), (sk, hk, dv, 1)))
    (q8, qd), (k8, kd), (v8, vd) = (_quantized(x, g, hk, seq) for x, g, seq in
                                    zip((q, k, v), grans, (False, False, v_seq_contiguous), strict=True))
    return q8, k8, v8, qd, kd, vd


def _fp8_varlen(gen, env, lens, extra, heads, dims, grans, v_seq_contiguous):
    """Packed e4m3 q, k, v (extra zero rows past the last sequence) and their descales: per tensor, or per
    sequence and head (each sequence quantised alone: (batch, heads) descales); a per-sequence granularity
    "tensor" drawn becomes "head" (a varlen descale is (1,) or (batch, heads))."""
    (lens_q, lens_k), (h, hk), (hd, dv) = lens, heads, dims
    if grans[0] == "tensor":  # per tensor: the packed tensors quantised at once
        parts = [_fp8_values(gen, 1, sum(n) + extra, heads_, dim, sign, env.device)
                 for n, heads_, dim, sign in ((lens_q, h, hd, -1), (lens_k, hk, hd, 1), (lens_k, hk, dv, 1))]
        (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(x, seq_contiguous=seq) for x, seq in
                                        zip(parts, (False, False, v_seq_contiguous), strict=True))
        return q8[0], k8[0], v8[0], qd, kd, vd
    seqs = []
    for lq, lk in zip(lens_q, lens_k, strict=True):
        q, k, v = (_fp8_values(gen, 1, s, n, dim, sign, env.device)
                   for s, n, dim, sign in ((lq, h, hd, -1), (lk, hk, hd, 1), (lk, hk, dv, 1)))
        seqs.append((_quantized(q, grans[0], hk), fp8.quantize(k, "head"), fp8.quantize(v, "head")))
    out = []
    for i in range(3):
        x8 = torch.cat([s[i][0][0] for s in seqs])
        x8 = torch.cat([x8, x8.new_zeros(extra, *x8.shape[1:])])
        out.append(x8)
    return (*out, *(torch.cat([s[i][1] for s in seqs]) for i in range(3)))
