"""Exact float32 attention of one block whose masks and ALiBi use explicit global positions.

The fallback for the blocks the single-device kernels cannot express: ALiBi on a block whose diagonal is
shifted from the kernel's own (``|pq + G − pk|`` with the key block away from the query block; the kernels
align ALiBi, like their masks, with the bottom-right corner of each call and take no offset). Plain PyTorch
on the tensors' device, chunked over query rows so that one score tile stays within a fixed budget; O(N·d)
extra memory like the kernels, but dense matmuls without the kernels' fusion, so slower on a GPU.
"""

from __future__ import annotations

import math

import torch

_TILE_BUDGET = 1 << 22  # score-tile elements (b · h · rows · keys) held at once: 16 MiB of float32


def _rows_per_chunk(b: int, h: int, n: int) -> int:
    return max(1, _TILE_BUDGET // max(1, b * h * n))


def _heads_first(x, hk: int):
    """(b, s, h, d) -> (b, hk, g, s, d) float32."""
    b, s, h, d = x.shape
    return x.float().view(b, s, hk, h // hk, d).permute(0, 2, 3, 1, 4)


def _scores(qc, kf, pos_q, pos_k, doc_q, doc_k, *, offset, left, right, scale, softcap, slopes):
    """Scores (b, hk, g, m, n) of a row chunk with softcap, ALiBi and the mask, and the softcap's tanh."""
    s = torch.matmul(qc * scale, kf.unsqueeze(2).transpose(-1, -2))  # (b,hk,g,m,d) x (b,hk,1,d,n)
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = t * softcap
    dist = pos_k.view(1, -1) - pos_q.view(-1, 1) - offset  # (m, n): key minus aligned query position
    if slopes is not None:
        s = s - slopes * dist.abs().to(s.dtype)
    vis = (dist >= -left) & (dist <= right)
    if doc_q is not None:
        vis &= doc_q.view(-1, 1) == doc_k.view(1, -1)
    return s.masked_fill(~vis, -math.inf), t


def _slopes5(slopes, b: int, hk: int, g: int, m: int, r0: int, r1: int):
    """slopes (b|1, h, m|1) -> (b|1, hk, g, rows, 1) for the row chunk [r0, r1)."""
    if slopes is None:
        return None
    s = slopes.float()
    s = s[..., r0:r1] if s.shape[-1] == m and m > 1 else s
    return s.reshape(s.shape[0], hk, g, s.shape[-1], 1)


def forward(q, k, v, pos_q, pos_k, *, offset: int, left: int, right: int, softmax_scale: float,
            softcap: float, slopes, doc_q=None, doc_k=None):
    """Attention of a block given every token's global position.

    Args:
        q: ``(b, m, h, d)``; k ``(b, n, h_k, d)``; v ``(b, n, h_k, d_v)``; any float dtype.
        pos_q, pos_k: int64 ``(m,)`` / ``(n,)`` global positions (shared by the batch).
        offset: ``seqlen_k − seqlen_q`` of the full problem.
        left, right: window sides as :func:`flashattn.distributed._geometry.band` takes them (UNBOUNDED for
            none, right 0 under causal).
        softmax_scale, softcap: as flash_attn_func.
        slopes: None or float32 ``(b|1, h, m|1)``: ALiBi slope of each (sequence, head, row).
        doc_q, doc_k: None, or int64 ``(m,)`` / ``(n,)`` document ids: tokens of different documents never
            see each other (varlen).

    Returns ``(out, lse)``: out float32 ``(b, m, h, d_v)``, lse float32 ``(b, h, m)`` (−inf: no key seen).
    """
    b, m, h, _ = q.shape
    hk, n = k.shape[2], k.shape[1]
    g = h // hk
    q5 = _heads_first(q, hk)
    kf, vf = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)  # (b, hk, n, ·)
    out = torch.zeros(b, m, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, m), -math.inf, dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(b, h, n)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        s, _ = _scores(q5[:, :, :, r0:r1], kf, pos_q[r0:r1], pos_k, None if doc_q is None else doc_q[r0:r1],
                       doc_k, offset=offset, left=left, right=right, scale=softmax_scale, softcap=softcap,
                       slopes=_slopes5(slopes, b, hk, g, m, r0, r1))
        mx = s.amax(dim=-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)  # rows with no key: exp(-inf) = 0
        p = torch.exp(s - mx)
        l_sum = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p, vf.unsqueeze(2)) / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))
        out[:, r0:r1] = o.permute(0, 3, 1, 2, 4).reshape(b, r1 - r0, h, -1)
        lse[..., r0:r1] = (mx + torch.log(l_sum)).squeeze(-1).reshape(b, h, r1 - r0)
    return out, lse


def backward(dout, q, k, v, out, lse, pos_q, pos_k, *, offset: int, left: int, right: int,
             softmax_scale: float, softcap: float, slopes, doc_q=None, doc_k=None):
    """Gradients of :func:`forward` against the final statistics: ``out`` (the final output rows) and
    ``lse`` (the final LSE, ``+inf`` for rows that see no key), as the kernels' backward takes them.

    Returns float32 ``(dq, dk, dv)`` shaped like q, k, v; dk/dv summed over each GQA group.
    """
    b, m, h, d = q.shape
    hk, n = k.shape[2], k.shape[1]
    g = h // hk
    q5, do5 = _heads_first(q, hk), _heads_first(dout, hk)
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO ∘ O), (b, m, h)
    delta5 = delta.view(b, m, hk, g).permute(0, 2, 3, 1).unsqueeze(-1)  # (b, hk, g, m, 1)
    lse5 = lse.float().reshape(b, hk, g, m, 1)
    kf, vf = k.float().permute(0, 2, 1, 3), v.float().permute(0, 2, 1, 3)
    dq = torch.zeros(b, m, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, hk, n, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(b, hk, n, v.shape[-1], dtype=torch.float32, device=q.device)
    step = _rows_per_chunk(b, h, n)
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        qc, doc = q5[:, :, :, r0:r1], do5[:, :, :, r0:r1]
        s, t = _scores(qc, kf, pos_q[r0:r1], pos_k, None if doc_q is None else doc_q[r0:r1], doc_k,
                       offset=offset, left=left, right=right, scale=softmax_scale, softcap=softcap,
                       slopes=_slopes5(slopes, b, hk, g, m, r0, r1))
        p = torch.exp(s - lse5[:, :, :, r0:r1])  # +inf LSE (row sees nothing) gives 0
        dv += torch.matmul(p.transpose(-1, -2), doc).sum(2)
        dp = torch.matmul(doc, vf.unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - delta5[:, :, :, r0:r1])
        if t is not None:
            ds = ds * (1 - t * t)  # d/dx c·tanh(x/c) = 1 − tanh²
        dq[:, r0:r1] = torch.matmul(ds, kf.unsqueeze(2)).mul_(softmax_scale).permute(0, 3, 1, 2, 4).reshape(
            b, r1 - r0, h, d)
        dk += torch.matmul(ds.transpose(-1, -2), qc).sum(2).mul_(softmax_scale)
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)
