"""The pure-PyTorch backend: FlashAttention's tiled algorithm over query and key/value chunks.

Exact (fp32 accumulation, online softmax) and O(N·d) extra memory: only one score tile of
``(batch, nheads, chunk, chunk)`` exists at a time, and the backward recomputes probabilities from the saved
LSE instead of storing them.  It serves CPU users and machines without Triton.  Same signatures and
semantics as the Triton launchers in ``flashattn.ops.attention``: pure functions, no autograd inside.

Layout inside: q is viewed as ``(b, hk, group, sq, d)`` so one batched matmul per tile covers every (batch,
head) pair and a GQA group shares its k/v chunk without repeating it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_forward", "attention_backward", "chunk_size"]

# Score-tile budget in elements (b * h * chunk * chunk): about 16 MiB of fp32 per live tile.
_TILE_BUDGET = 1 << 22
_MIN_CHUNK, _MAX_CHUNK = 128, 1024


def chunk_size(batch_heads: int) -> int:
    """Query/key chunk length: the largest power of two in [128, 1024] whose tile fits the budget."""
    c = _MAX_CHUNK
    while c > _MIN_CHUNK and batch_heads * c * c > _TILE_BUDGET:
        c //= 2
    return c


def _compute_dtype(*tensors):
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _copy_as(x, dtype):
    """A contiguous copy of ``x`` in ``dtype`` (one copy, whatever x's strides and dtype)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def _check(q, k, v, alibi_slopes):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, seqlen, nheads, headdim); got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, _, h, d = q.shape
    hk = k.shape[2]
    if k.shape[3] != d:
        raise ValueError(f"k has headdim {k.shape[3]} but q has {d}; q and k must share the head dimension")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"k has {hk} heads but q has {h}; nheads must be a multiple of nheads_k (GQA)")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; expected ({h},) or ({b}, {h})")
    return h // hk


class _Tiles:
    """Everything one (query chunk, key chunk) tile needs to produce its masked, biased scores."""

    def __init__(self, q, k, *, causal, window_size, softcap, alibi_slopes, group, cdtype):
        b, sq, h, _ = q.shape
        self.sq, self.sk = sq, k.shape[1]
        self.offset = self.sk - sq  # query i is aligned with key i + offset (bottom-right)
        left, right = window_size
        self.left = left if left >= 0 else None
        self.right = 0 if causal else (right if right >= 0 else None)
        self.softcap = softcap
        self.chunk = chunk_size(b * h)
        self.slopes = None
        if alibi_slopes is not None:
            # (h,) or (b, h) -> (b|1, hk, group, 1, 1), matching the (b, hk, group, m, n) tile
            s = alibi_slopes.to(device=q.device, dtype=cdtype)
            self.slopes = s.reshape(-1, h // group, group, 1, 1)

    def key_range(self, i0, i1):
        """Keys [lo, hi) that some query in [i0, i1) may see; chunks outside it are skipped entirely."""
        lo = 0 if self.left is None else max(0, i0 + self.offset - self.left)
        hi = self.sk if self.right is None else min(self.sk, i1 - 1 + self.offset + self.right + 1)
        return lo, hi

    def mask(self, i0, i1, j0, j1, device):
        """Bool (m, n) visibility, or None when every query of the chunk sees every key of it."""
        full_right = self.right is None or j1 - 1 <= i0 + self.offset + self.right
        full_left = self.left is None or j0 >= i1 - 1 + self.offset - self.left
        if full_right and full_left:
            return None
        diag = torch.arange(i0, i1, device=device).view(-1, 1) + self.offset
        j = torch.arange(j0, j1, device=device).view(1, -1)
        vis = torch.ones(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
        if self.right is not None:
            vis &= j <= diag + self.right
        if self.left is not None:
            vis &= j >= diag - self.left
        return vis

    def scores(self, qs, kc, shape5, i0, i1, j0, j1, keep_tanh=False):
        """Scaled, softcapped, ALiBi-biased, masked scores ``(b, hk, g, m, n)``, and with ``keep_tanh`` the
        softcap's tanh (the backward needs it for the derivative; None without softcap).

        ``qs`` is the query chunk already multiplied by softmax_scale, ``(b, hk, g*m, d)``.
        """
        s = torch.matmul(qs, kc.transpose(-1, -2)).view(shape5)  # (b, hk, g*m, d) x (b, hk, d, n)
        t = None
        if self.softcap > 0:
            if keep_tanh:
                t = s.div_(self.softcap).tanh_()
                s = t * self.softcap
            else:
                s.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.slopes is not None:
            rows = torch.arange(i0, i1, device=s.device).view(-1, 1) + self.offset
            dist = (rows - torch.arange(j0, j1, device=s.device).view(1, -1)).abs().to(s.dtype)
            s.sub_(self.slopes * dist)
        vis = self.mask(i0, i1, j0, j1, s.device)
        if vis is not None:
            s.masked_fill_(~vis, -math.inf)
        return s, t


def _heads_first(x, group):
    """(b, s, h, d) -> (b, hk, group, s, d) view."""
    return x.unflatten(2, (x.shape[2] // group, group)).permute(0, 2, 3, 1, 4)


def attention_forward(
    q, k, v, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None
):
    """Chunked exact attention.

    Args: q ``(b, sq, h, d)``, k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)`` (any strides, ``h % hk == 0``);
    the keyword arguments have the meaning of :func:`flashattn.reference.attention_ref`.

    Returns ``(out, lse)``: out ``(b, sq, h, dv)`` in q's dtype, lse ``(b, h, sq)`` natural log, float32
    (float64 for float64 inputs), ``+inf`` where a row sees no key (its output is 0).
    """
    group = _check(q, k, v, alibi_slopes)
    b, sq, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    cdtype = _compute_dtype(q, k, v)
    tiles = _Tiles(
        q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        group=group, cdtype=cdtype,
    )
    out = torch.zeros(b, sq, h, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, sq), math.inf, dtype=cdtype, device=q.device)
    out5 = out.view(b, sq, hk, group, dv)
    lse4 = lse.view(b, hk, group, sq)
    q5 = _heads_first(q, group)
    # k, v once in the compute dtype, (b, hk, sk, d): O(N d) and saves a cast per tile
    kf = _copy_as(k.permute(0, 2, 1, 3), cdtype)
    vf = _copy_as(v.permute(0, 2, 1, 3), cdtype)
    c = tiles.chunk

    for i0 in range(0, sq, c):
        i1 = min(i0 + c, sq)
        m = i1 - i0
        lo, hi = tiles.key_range(i0, i1)
        if lo >= hi:
            continue  # no query of this chunk sees a key: out stays 0, lse +inf
        qs = _copy_as(q5[:, :, :, i0:i1], cdtype).mul_(softmax_scale).view(b, hk, group * m, d)
        m_i = torch.full((b, hk, group, m), -math.inf, dtype=cdtype, device=q.device)
        l_i = torch.zeros(b, hk, group, m, dtype=cdtype, device=q.device)
        acc = torch.zeros(b, hk, group * m, dv, dtype=cdtype, device=q.device)
        for j0 in range(lo, hi, c):
            j1 = min(j0 + c, hi)
            s, _ = tiles.scores(qs, kf[:, :, j0:j1], (b, hk, group, m, j1 - j0), i0, i1, j0, j1)
            # -- update m_i and l_i; rows with nothing seen yet keep m = -inf, exponentiate against 0 there
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m_i - m_ref)
            p = s.sub_(m_ref.unsqueeze(-1)).exp_()
            l_i = l_i * alpha + p.sum(dim=-1)
            # -- rescale acc and add P V: (b, hk, g*m, n) x (b, hk, n, dv) -> (b, hk, g*m, dv)
            acc.mul_(alpha.view(b, hk, group * m, 1))
            acc.add_(torch.matmul(p.view(b, hk, group * m, j1 - j0), vf[:, :, j0:j1]))
            m_i = m_new
        empty = l_i == 0
        l_safe = torch.where(empty, torch.ones_like(l_i), l_i)
        o = acc.view(b, hk, group, m, dv) / l_safe.unsqueeze(-1)
        out5[:, i0:i1] = o.permute(0, 3, 1, 2, 4)
        lse4[..., i0:i1] = torch.where(empty, torch.full_like(l_i, math.inf), m_i + torch.log(l_safe))
    return out, lse


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    softmax_scale: float,
    causal: bool,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
):
    """Gradients of :func:`attention_forward` by recomputation from the saved ``lse``.

    Returns ``(dq, dk, dv)`` shaped like q, k, v in their dtypes; dk/dv are summed over each GQA group and
    rows that saw no key contribute nothing.  Always deterministic (sequential accumulation), so
    ``deterministic`` changes nothing.
    """
    del deterministic
    group = _check(q, k, v, alibi_slopes)
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    cdtype = _compute_dtype(q, k, v)
    tiles = _Tiles(
        q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        group=group, cdtype=cdtype,
    )
    q5, do5, o5 = _heads_first(q, group), _heads_first(dout, group), _heads_first(out, group)
    lse4 = lse.unflatten(1, (hk, group))
    kf = _copy_as(k.permute(0, 2, 1, 3), cdtype)
    vf = _copy_as(v.permute(0, 2, 1, 3), cdtype)
    dq = torch.zeros(b, sq, h, d, dtype=q.dtype, device=q.device)
    dq5 = dq.view(b, sq, hk, group, d)
    dk_acc = torch.zeros(b, hk, sk, d, dtype=cdtype, device=q.device)
    dv_acc = torch.zeros(b, hk, sk, dv, dtype=cdtype, device=q.device)
    c = tiles.chunk

    for i0 in range(0, sq, c):
        i1 = min(i0 + c, sq)
        m = i1 - i0
        lo, hi = tiles.key_range(i0, i1)
        if lo >= hi:
            continue
        qs = _copy_as(q5[:, :, :, i0:i1], cdtype).mul_(softmax_scale).view(b, hk, group * m, d)
        doc = _copy_as(do5[:, :, :, i0:i1], cdtype)  # (b, hk, g, m, dv)
        # D_i = rowsum(dO * O): the softmax-Jacobian term, one number per row
        delta = (doc * o5[:, :, :, i0:i1].to(cdtype)).sum(dim=-1, keepdim=True)  # (b, hk, g, m, 1)
        doc = doc.view(b, hk, group * m, dv)
        lse_c = lse4[..., i0:i1].to(cdtype).unsqueeze(-1)  # (b, hk, g, m, 1); +inf rows give P = 0
        dq_acc = torch.zeros(b, hk, group * m, d, dtype=cdtype, device=q.device)
        for j0 in range(lo, hi, c):
            j1 = min(j0 + c, hi)
            n = j1 - j0
            kc, vc = kf[:, :, j0:j1], vf[:, :, j0:j1]
            s, t = tiles.scores(qs, kc, (b, hk, group, m, n), i0, i1, j0, j1, keep_tanh=True)
            p = s.sub_(lse_c).exp_()  # (b, hk, g, m, n)
            p2 = p.view(b, hk, group * m, n)
            # dV += P^T dO, summed over the group and the chunk rows: (b, hk, n, g*m) x (b, hk, g*m, dv)
            dv_acc[:, :, j0:j1] += torch.matmul(p2.transpose(-1, -2), doc)
            # dS = P * (dP - D), dP = dO V^T
            ds = torch.matmul(doc, vc.transpose(-1, -2)).view(b, hk, group, m, n).sub_(delta).mul_(p)
            if t is not None:
                ds.mul_(1 - t * t)  # d/dx c*tanh(x/c) = 1 - tanh^2
            ds2 = ds.view(b, hk, group * m, n)
            # dK += dS^T (Q * scale); dQ += dS K (scaled once after the loop)
            dk_acc[:, :, j0:j1] += torch.matmul(ds2.transpose(-1, -2), qs)
            dq_acc += torch.matmul(ds2, kc)
        dq5[:, i0:i1] = dq_acc.mul_(softmax_scale).view(b, hk, group, m, d).permute(0, 3, 1, 2, 4)

    dk = torch.empty(b, sk, hk, d, dtype=k.dtype, device=k.device)
    dk.copy_(dk_acc.permute(0, 2, 1, 3))
    dv_out = torch.empty(b, sk, hk, dv, dtype=v.dtype, device=v.device)
    dv_out.copy_(dv_acc.permute(0, 2, 1, 3))
    return dq, dk, dv_out
