"""Backward pass over one group of equal-length sequences, by recomputation from the saved LSE.

With the dropout keep-mask Z (0 or 1/(1-p)) the forward is O = (P∘Z) V, so
dV = (P∘Z)ᵀ dO, dP = dO Vᵀ, dS = P∘(dP∘Z − D) with D = rowsum(dO∘O) (rowsum(P∘Z∘dP) is exactly D), and
the sink, a logit with no value, gets d sink_h = −Σ_rows exp(sink_h − lse)·D.  For that sum D is
accumulated as Σ_j P∘dP∘Z in the compute dtype (as the Triton kernel does): rowsum(dO∘O) would carry O's
rounding to 16 bits straight into d sink, where nothing cancels it.
"""

from __future__ import annotations

import torch

from flashattn.backends.torch.tiles import Tiles, copy_as, exp_, heads_first


def backward_group(tiles: Tiles, dout, q, k, v, out, lse, dq, dk, dv, dsink) -> None:
    """Writes ``dq`` ``(nb, sq, h, d)``, ``dk``/``dv`` ``(nb, sk, hk, ·)`` (views into the caller's
    buffers) and adds this group's sink gradient to ``dsink`` ``(hk, group)`` when it is not None.

    ``lse`` ``(nb, h, sq)``: the forward's; rows that saw no key (``+inf`` or the sink) get P = 0 and D = 0,
    so they contribute nothing.
    """
    spec, cdtype = tiles.spec, tiles.spec.cdtype
    nb, sq, _, d = q.shape
    sk, hk, group, dv_dim = k.shape[1], tiles.hk, tiles.group, v.shape[3]
    q5, do5, o5 = heads_first(q, group), heads_first(dout, group), heads_first(out, group)
    lse4 = lse.unflatten(1, (hk, group))
    kf = copy_as(k.permute(0, 2, 1, 3), cdtype)
    vf = copy_as(v.permute(0, 2, 1, 3), cdtype)
    dq5 = dq.unflatten(2, (hk, group))  # (nb, sq, hk, g, d)
    dk_acc = torch.zeros(nb, hk, sk, d, dtype=cdtype, device=q.device)
    dv_acc = torch.zeros(nb, hk, sk, dv_dim, dtype=cdtype, device=q.device)
    c = tiles.chunk

    for i0 in range(0, sq, c):
        i1 = min(i0 + c, sq)
        m = i1 - i0
        lo, hi = tiles.key_range(i0, i1)
        if lo >= hi:
            dq5[:, i0:i1] = 0
            continue
        qs = copy_as(q5[:, :, :, i0:i1], cdtype).mul_(spec.softmax_scale).view(nb, hk, group * m, d)
        doc = copy_as(do5[:, :, :, i0:i1], cdtype)  # (nb, hk, g, m, dv)
        # D_i = rowsum(dO * O): the softmax-Jacobian term, one number per row
        delta = (doc * o5[:, :, :, i0:i1].to(cdtype)).sum(dim=-1, keepdim=True)  # (nb, hk, g, m, 1)
        doc = doc.view(nb, hk, group * m, dv_dim)
        lse_c = lse4[..., i0:i1].to(cdtype).unsqueeze(-1)  # (nb, hk, g, m, 1); +inf rows give P = 0
        pdp = torch.zeros_like(delta) if dsink is not None else None
        dq_acc = torch.zeros(nb, hk, group * m, d, dtype=cdtype, device=q.device)
        for j0 in range(lo, hi, c):
            j1 = min(j0 + c, hi)
            n = j1 - j0
            kc, vc = kf[:, :, j0:j1], vf[:, :, j0:j1]
            s, t = tiles.scores(qs, kc, i0, i1, j0, j1, keep_tanh=True)
            p = exp_(s.sub_(lse_c), tiles.partial(i0, i1, j0, j1))  # (nb, hk, g, m, n)
            keep = tiles.keep(i0, i1, j0, j1, q.device)
            p_drop = p if keep is None else p.masked_fill(~keep, 0.0).mul_(spec.drop_scale)
            # dV += (P∘Z)^T dO, summed over the group and the chunk rows: (nb, hk, n, g*m) x (nb, hk, g*m, dv)
            dv_acc[:, :, j0:j1] += torch.matmul(p_drop.view(nb, hk, group * m, n).transpose(-1, -2), doc)
            # dS = P * (dP∘Z - D), dP = dO V^T
            dp = torch.matmul(doc, vc.transpose(-1, -2)).view(nb, hk, group, m, n)
            if keep is not None:
                dp.masked_fill_(~keep, 0.0).mul_(spec.drop_scale)
            if pdp is not None:
                pdp += (p * dp).sum(dim=-1, keepdim=True)
            ds = dp.sub_(delta).mul_(p)
            if t is not None:
                ds.mul_(1 - t * t)  # d/dx c*tanh(x/c) = 1 - tanh^2
            ds2 = ds.view(nb, hk, group * m, n)
            # dK += dS^T (Q * scale); dQ += dS K (scaled once after the loop)
            dk_acc[:, :, j0:j1] += torch.matmul(ds2.transpose(-1, -2), qs)
            dq_acc += torch.matmul(ds2, kc)
        if dsink is not None:
            # -- sink: probability exp(sink - lse) per row, times -D, summed over sequences and rows
            p_sink = torch.exp(tiles.sink.unsqueeze(-1) - lse_c)
            dsink -= (p_sink * pdp).sum(dim=(0, 3, 4))
        dq5[:, i0:i1] = dq_acc.mul_(spec.softmax_scale).view(nb, hk, group, m, d).permute(0, 3, 1, 2, 4)

    dk.copy_(dk_acc.permute(0, 2, 1, 3))
    dv.copy_(dv_acc.permute(0, 2, 1, 3))
