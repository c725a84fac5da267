"""Chunk sizing and the per-tile work shared by forward and backward: scores with softcap, ALiBi and the
visibility mask, the dropout keep-mask, the sink.

A tile is one (query chunk, key chunk) pair of a group of sequences that share their lengths (the whole
batch in the padded layout, one sequence in the varlen layout), viewed as ``(nb, hk, group, m, n)`` so that
one batched matmul covers every (sequence, head) pair and a GQA group shares its k/v chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashattn.dropout import dropout_keep_chunk

# Score-tile budget in elements (b * h * chunk * chunk): about 16 MiB of fp32 per live tile.
_TILE_BUDGET = 1 << 22
_MIN_CHUNK, _MAX_CHUNK = 128, 1024


def chunk_size(batch_heads: int) -> int:
    """Query/key chunk length: the largest power of two in [128, 1024] whose tile fits the budget."""
    c = _MAX_CHUNK
    while c > _MIN_CHUNK and batch_heads * c * c > _TILE_BUDGET:
        c //= 2
    return c


LOG2E = 1.4426950408889634


def exp_(x, masked: bool = True):
    """exp(x) in place. masked: x may hold -inf (masked scores). Where exp's result underflows, torch's CPU
    exp (float32, AVX-512) takes a slow path: on a tile whose masked half is -inf it ran 5x slower than on
    finite scores, at -200 14x (the cost of a whole causal forward). So a masked tile goes through
    exp2(x · log2 e), as fast there as on finite values, for one more pass over the tile; an unmasked one
    keeps exp (that pass made non-causal calls 7-21% slower). The product's rounding adds at most
    |x| · 2^-24 to the exponent (a relative error of ~1e-6 at x = -20)."""
    return x.mul_(LOG2E).exp2_() if masked else x.exp_()


def compute_dtype(*tensors):
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def copy_as(x, dtype):
    """A contiguous copy of ``x`` in ``dtype`` (one copy, whatever x's strides and dtype)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device).copy_(x)


def heads_first(x, group):
    """(b, s, h, d) -> (b, hk, group, s, d) view."""
    return x.unflatten(2, (x.shape[2] // group, group)).permute(0, 2, 3, 1, 4)


@dataclass(frozen=True)
class Spec:
    """The call's scalar options, identical for every group of sequences."""

    softmax_scale: float
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    dropout_p: float
    rng_seed: int
    rng_offset: int
    cdtype: torch.dtype

    @property
    def drop_scale(self) -> float:
        return 1.0 / (1.0 - self.dropout_p)


class Tiles:
    """Everything one tile of a group of equal-length sequences needs.

    Args:
        q: ``(nb, sq, h, d)``; k: ``(nb, sk, hk, d)``.
        alibi_slopes: ``(h,)`` or ``(nb, h)`` for these sequences, or None.
        sink: ``(h,)`` or None.
        batch_idx: the sequences' batch indices (int64 ``(nb,)``), for the dropout counters.
        max_seqlen_q, max_seqlen_k: the dropout counter strides.
    """

    def __init__(self, spec: Spec, q, k, *, alibi_slopes, sink, batch_idx, max_seqlen_q, max_seqlen_k):
        nb, sq, h, _ = q.shape
        hk = k.shape[2]
        self.spec = spec
        self.nb, self.h, self.hk, self.group = nb, h, hk, h // hk
        self.sq, self.sk = sq, k.shape[1]
        self.offset = self.sk - sq  # query i is aligned with key i + offset (bottom-right)
        left, right = spec.window_size
        self.left = left if left >= 0 else None
        self.right = 0 if spec.causal else (right if right >= 0 else None)
        self.chunk = chunk_size(nb * h)
        self.slopes = None
        if alibi_slopes is not None:
            # (h,) or (nb, h) -> (nb|1, hk, group, 1, 1), matching the (nb, hk, group, m, n) tile
            s = alibi_slopes.to(device=q.device, dtype=spec.cdtype)
            self.slopes = s.reshape(-1, hk, self.group, 1, 1)
        self.sink = None
        if sink is not None:
            self.sink = sink.to(device=q.device, dtype=spec.cdtype).view(hk, self.group, 1)
        self.batch_idx = batch_idx
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k

    def key_range(self, i0, i1):
        """Keys [lo, hi) that some query in [i0, i1) may see; chunks outside it are skipped entirely."""
        lo = 0 if self.left is None else max(0, i0 + self.offset - self.left)
        hi = self.sk if self.right is None else min(self.sk, i1 - 1 + self.offset + self.right + 1)
        return lo, hi

    def partial(self, i0, i1, j0, j1) -> bool:
        """Whether some query of the chunk does not see some key of it (the tile is masked)."""
        full_right = self.right is None or j1 - 1 <= i0 + self.offset + self.right
        full_left = self.left is None or j0 >= i1 - 1 + self.offset - self.left
        return not (full_right and full_left)

    def mask_bias(self, i0, i1, j0, j1, device):
        """The (m, n) visibility as an additive bias in the compute dtype (0 where a query sees a key, -inf
        where not), or None when every query of the chunk sees every key of it. Added to a tile's finite
        scores it masks them as a masked fill would, at a fifth of its CPU time (broadcast over the batch
        and heads, torch's masked_fill_ ran 3.3 ms on a 2M-element float32 tile, add_ 0.2)."""
        if not self.partial(i0, i1, j0, j1):
            return None
        diag = torch.arange(i0, i1, device=device).view(-1, 1) + self.offset
        j = torch.arange(j0, j1, device=device).view(1, -1)
        hidden = torch.zeros(i1 - i0, j1 - j0, dtype=torch.bool, device=device)
        if self.right is not None:
            hidden |= j > diag + self.right
        if self.left is not None:
            hidden |= j < diag - self.left
        bias = torch.zeros(hidden.shape, dtype=self.spec.cdtype, device=device)
        return bias.masked_fill_(hidden, -math.inf)

    def scores(self, qs, kc, i0, i1, j0, j1, keep_tanh=False):
        """Scaled, softcapped, ALiBi-biased, masked scores ``(nb, hk, g, m, n)``, and with ``keep_tanh`` the
        softcap's tanh (the backward needs it for the derivative; None without softcap).

        ``qs`` is the query chunk already multiplied by softmax_scale, ``(nb, hk, g*m, d)``.
        """
        softcap = self.spec.softcap
        shape5 = (self.nb, self.hk, self.group, i1 - i0, j1 - j0)
        s = torch.matmul(qs, kc.transpose(-1, -2)).view(shape5)  # (nb, hk, g*m, d) x (nb, hk, d, n)
        t = None
        if softcap > 0:
            if keep_tanh:
                t = s.div_(softcap).tanh_()
                s = t * softcap
            else:
                s.div_(softcap).tanh_().mul_(softcap)
        if self.slopes is not None:
            rows = torch.arange(i0, i1, device=s.device).view(-1, 1) + self.offset
            dist = (rows - torch.arange(j0, j1, device=s.device).view(1, -1)).abs().to(s.dtype)
            s.sub_(self.slopes * dist)
        bias = self.mask_bias(i0, i1, j0, j1, s.device)
        if bias is not None:
            s.add_(bias)
        return s, t

    def keep(self, i0, i1, j0, j1, device):
        """Dropout keep-mask ``(nb, hk, g, m, n)`` of the tile, or None without dropout."""
        if self.spec.dropout_p == 0.0:
            return None
        keep = dropout_keep_chunk(
            self.spec.rng_seed, self.spec.rng_offset, self.batch_idx, self.h, i0, i1, j0, j1,
            self.spec.dropout_p, max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
            device=device,
        )
        return keep.view(self.nb, self.hk, self.group, i1 - i0, j1 - j0)

    def initial_state(self, m, device):
        """Running max and normaliser ``(nb, hk, g, m)`` before any key: the sink is a key with no value,
        so starting from ``(m, l) = (sink, 1)`` folds it in (``l = 0`` for a ``-inf`` sink)."""
        shape = (self.nb, self.hk, self.group, m)
        if self.sink is None:
            return (torch.full(shape, -math.inf, dtype=self.spec.cdtype, device=device),
                    torch.zeros(shape, dtype=self.spec.cdtype, device=device))
        m_i = self.sink.expand(shape).clone()
        return m_i, (m_i > -math.inf).to(self.spec.cdtype)

    def empty_lse(self, m, device):
        """LSE of rows that see no key: the sink, else +inf."""
        m_i, l_i = self.initial_state(m, device)
        return torch.where(l_i > 0, m_i, torch.full_like(m_i, math.inf))
