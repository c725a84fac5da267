"""GPU smoke check of every training feature in bf16 against the fp64 oracle (tolerance rule), small shapes.

Usage (on the device): PYTHONPATH=src python scripts/gpu_features_check.py
"""

import sys

import torch

import flashattn
from flashattn.reference import attention_ref


def _err(a, ref):
    return (a.double() - ref).abs().max().item()


def run_case(name, b, sq, sk, h, hk, d, dv=None, varlen=None, **kw):
    dv = dv or d
    dt = torch.bfloat16
    sink = kw.pop("sink", False)
    p = kw.pop("dropout_p", 0.0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dt, requires_grad=True)
    s = torch.randn(h, device="cuda", requires_grad=True) if sink else None
    if kw.get("alibi_slopes") is True:
        kw["alibi_slopes"] = torch.rand(h, device="cuda") * 0.3
    out, _, mask = flashattn.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, learnable_sink=s,
                                             **kw)
    ref_kw = dict(kw, learnable_sink=s, dropout_p=p, dropout_mask=mask)
    ref, _ = attention_ref(q, k, v, **ref_kw)
    pt, _ = attention_ref(q, k, v, upcast=False, **ref_kw)
    dout = torch.randn_like(out)
    ins = [q, k, v] + ([s] if sink else [])
    g = torch.autograd.grad(out, ins, dout)
    gr = torch.autograd.grad(ref, ins, dout.double())
    gp = torch.autograd.grad(pt, ins, dout)
    checks = [("out", _err(out, ref), _err(pt, ref), 2)]
    checks += [(f"d{n}", _err(a, r), _err(c, r), 3) for n, a, r, c in zip("qkvs", g, gr, gp, strict=False)]
    ok = all(e <= f * e_pt + 1e-4 for _, e, e_pt, f in checks) and torch.isfinite(out).all().item()
    detail = ", ".join(f"{n} {e:.1e}/{e_pt:.1e}" for n, e, e_pt, _ in checks)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


CASES = [
    ("causal sq<sk", dict(b=2, sq=300, sk=517, h=4, hk=2, d=64, causal=True)),
    ("causal sq>sk", dict(b=2, sq=517, sk=300, h=4, hk=4, d=128, causal=True)),
    ("window 64,32", dict(b=2, sq=700, sk=700, h=4, hk=1, d=64, window_size=(64, 32))),
    ("window 100 causal", dict(b=1, sq=1023, sk=1023, h=4, hk=2, d=128, window_size=(100, -1), causal=True)),
    ("softcap 5", dict(b=2, sq=300, sk=300, h=4, hk=2, d=64, softcap=5.0)),
    ("alibi causal", dict(b=2, sq=300, sk=400, h=4, hk=2, d=64, alibi_slopes=True, causal=True)),
    ("sink", dict(b=2, sq=300, sk=300, h=4, hk=2, d=64, sink=True, causal=True)),
    ("dropout 0.2", dict(b=2, sq=256, sk=300, h=4, hk=2, d=64, dropout_p=0.2, causal=True)),
    ("dv != d (192/128)", dict(b=1, sq=300, sk=300, h=4, hk=2, d=192, dv=128, causal=True)),
    ("d=40 everything", dict(b=2, sq=333, sk=333, h=8, hk=2, d=40, causal=True, window_size=(50, -1),
                             softcap=10.0, alibi_slopes=True, sink=True, dropout_p=0.1)),
    ("d=256", dict(b=1, sq=200, sk=300, h=2, hk=1, d=256, causal=True)),
]


def varlen_case():
    dt = torch.bfloat16
    lens = [0, 1, 517, 300, 1000, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 8, 64, device="cuda", dtype=dt, requires_grad=True)
    k = torch.randn(sum(lens), 2, 64, device="cuda", dtype=dt, requires_grad=True)
    v = torch.randn(sum(lens), 2, 64, device="cuda", dtype=dt, requires_grad=True)
    out = flashattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                           window_size=(128, -1))
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    ok = True
    for i, n in enumerate(lens):
        if n == 0:
            continue
        sl = slice(int(cu[i]), int(cu[i + 1]))
        qi, ki, vi = (t[sl][None].detach().requires_grad_() for t in (q, k, v))
        ref, _ = attention_ref(qi, ki, vi, causal=True, window_size=(128, -1))
        pt, _ = attention_ref(qi, ki, vi, causal=True, window_size=(128, -1), upcast=False)
        gr = torch.autograd.grad(ref, (qi, ki, vi), dout[sl][None].double())
        gp = torch.autograd.grad(pt, (qi, ki, vi), dout[sl][None])
        ok &= _err(out[sl][None], ref) <= 2 * _err(pt, ref) + 1e-4
        for a, r, c in zip(g, gr, gp, strict=True):
            ok &= _err(a[sl][None], r) <= 3 * _err(c, r) + 1e-4
    print(f"{'ok  ' if ok else 'FAIL'} varlen (lengths {lens}, causal, window 128)", flush=True)
    return ok


if __name__ == "__main__":
    torch.manual_seed(0)
    results = [run_case(name, **kw) for name, kw in CASES] + [varlen_case()]
    print(f"{sum(not r for r in results)} failures of {len(results)}")
    sys.exit(0 if all(results) else 1)
