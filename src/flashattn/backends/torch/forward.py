"""Forward pass over one group of equal-length sequences: the online softmax over key chunks."""

from __future__ import annotations

import math

import torch

from flashattn.backends.torch.tiles import Tiles, copy_as, exp_, heads_first


def forward_group(tiles: Tiles, q, k, v, out, lse) -> None:
    """Writes ``out`` ``(nb, sq, h, dv)`` and ``lse`` ``(nb, h, sq)`` (views into the caller's buffers).

    q ``(nb, sq, h, d)``, k ``(nb, sk, hk, d)``, v ``(nb, sk, hk, dv)``, any strides.  A row that sees no
    key gets out 0 and lse = sink (+inf without a sink).
    """
    spec, cdtype = tiles.spec, tiles.spec.cdtype
    nb, sq, _, d = q.shape
    hk, group, dv = tiles.hk, tiles.group, v.shape[3]
    out5 = out.unflatten(2, (hk, group))  # (nb, sq, hk, g, dv)
    lse4 = lse.unflatten(1, (hk, group))  # (nb, hk, g, sq)
    q5 = heads_first(q, group)
    # k, v once in the compute dtype, (nb, hk, sk, d): O(N d) and saves a cast per tile
    kf = copy_as(k.permute(0, 2, 1, 3), cdtype)
    vf = copy_as(v.permute(0, 2, 1, 3), cdtype)
    c = tiles.chunk

    for i0 in range(0, sq, c):
        i1 = min(i0 + c, sq)
        m = i1 - i0
        lo, hi = tiles.key_range(i0, i1)
        if lo >= hi:
            out5[:, i0:i1] = 0
            lse4[..., i0:i1] = tiles.empty_lse(m, q.device)
            continue
        qs = copy_as(q5[:, :, :, i0:i1], cdtype).mul_(spec.softmax_scale).view(nb, hk, group * m, d)
        # the running max and normaliser: from the sink where there is one (a key with no value), else from
        # the first key chunk, which then has nothing to rescale (fewer operations a call: at small shapes
        # their count, not the arithmetic, sets the CPU time)
        m_i, l_i = (None, None) if tiles.sink is None else tiles.initial_state(m, q.device)
        acc = None
        for j0 in range(lo, hi, c):
            j1 = min(j0 + c, hi)
            s, _ = tiles.scores(qs, kf[:, :, j0:j1], i0, i1, j0, j1)
            # -- update m_i and l_i; rows with nothing seen yet keep m = -inf, exponentiate against 0 there
            m_new = s.amax(dim=-1) if m_i is None else torch.maximum(m_i, s.amax(dim=-1))
            m_ref = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = exp_(s.sub_(m_ref.unsqueeze(-1)), tiles.partial(i0, i1, j0, j1))
            # the normaliser counts every probability; dropout only zeroes what reaches V
            alpha = None if m_i is None else torch.exp(m_i - m_ref)
            l_i = p.sum(dim=-1) if alpha is None else l_i * alpha + p.sum(dim=-1)
            keep = tiles.keep(i0, i1, j0, j1, q.device)
            if keep is not None:
                p.masked_fill_(~keep, 0.0)
            # -- rescale acc and add P V: (nb, hk, g*m, n) x (nb, hk, n, dv) -> (nb, hk, g*m, dv)
            pv = torch.matmul(p.view(nb, hk, group * m, j1 - j0), vf[:, :, j0:j1])
            acc = pv if acc is None else acc.mul_(alpha.view(nb, hk, group * m, 1)).add_(pv)
            m_i = m_new
        empty = l_i == 0
        l_safe = torch.where(empty, 1.0, l_i)
        lse4[..., i0:i1] = torch.where(empty, math.inf, m_i + torch.log(l_safe))
        if spec.dropout_p > 0:
            l_safe = l_safe * (1.0 - spec.dropout_p)  # kept probabilities scaled by 1 / (1 - p)
        o = acc.view(nb, hk, group, m, dv) / l_safe.unsqueeze(-1)
        out5[:, i0:i1] = o.permute(0, 3, 1, 2, 4)
