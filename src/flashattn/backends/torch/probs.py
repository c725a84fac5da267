"""``attention_probs``: flash_attn's S_dmask in plain PyTorch, the form kernels/triton/probs.py describes
(key tiles ``block_n`` wide visited last to first, each entry ``exp(s - running max)``, the sign bit on
dropped entries, +0 on entries a query does not see and past the sequences), from the same scores and keep
mask as the forward (:class:`.tiles.Tiles`)."""

from __future__ import annotations

import torch

from flashattn.backends.torch.attention import _groups, _prepare, _tokens
from flashattn.backends.torch.tiles import Tiles, copy_as, heads_first
from flashattn.dropout import s_dmask_shape

__all__ = ["attention_probs"]


def attention_probs(
    q, k, *, softmax_scale: float, causal: bool, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, rng_seed=0, rng_offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
    max_seqlen_k=None, block_n: int = 64,
):
    """S_dmask ``dropout.s_dmask_shape(batch, nheads, max lengths)`` in q's dtype; layouts as
    :func:`.attention.attention_forward`'s (k also stands in for v, which S_dmask does not read)."""
    kw = dict(
        softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset,
        learnable_sink=None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    spec, varlen = _prepare(q, k, k, kw)
    if varlen:
        batch, mq, mk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
    else:
        batch, mq, mk = q.shape[0], q.shape[1], k.shape[1]
    probs = torch.zeros(s_dmask_shape(batch, q.shape[-2], mq, mk), dtype=q.dtype, device=q.device)
    groups = _groups(q, k, k, alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    for idx, qsl, ksl, slopes, gq, gk in groups:
        qg, kg = _tokens(q, qsl), _tokens(k, ksl)
        if qg.shape[1] and kg.shape[1]:
            tiles = Tiles(spec, qg, kg, alibi_slopes=slopes, sink=None, batch_idx=idx, max_seqlen_q=gq,
                          max_seqlen_k=gk)
            # the padded layout is one group of the whole batch; a varlen group is one sequence
            rows = probs if qsl is None else probs[int(idx[0]) : int(idx[0]) + 1]
            _group_probs(tiles, qg, kg, rows, block_n)
    return probs


def _group_probs(tiles: Tiles, q, k, out, block_n: int) -> None:
    """Writes the (nb, h, sq, sk) corner of ``out`` (a view) for one group of equal-length sequences."""
    spec = tiles.spec
    nb, sq, _, d = q.shape
    sk, hk, group = k.shape[1], tiles.hk, tiles.group
    q5 = heads_first(q, group)  # (nb, hk, g, sq, d)
    kf = copy_as(k.permute(0, 2, 1, 3), spec.cdtype)  # (nb, hk, sk, d)
    out5 = out.unflatten(1, (hk, group))  # (nb, hk, g, rows, cols)
    for i0 in range(0, sq, tiles.chunk):
        i1 = min(i0 + tiles.chunk, sq)
        m = i1 - i0
        qs = copy_as(q5[:, :, :, i0:i1], spec.cdtype).mul_(spec.softmax_scale).view(nb, hk, group * m, d)
        m_run, _ = tiles.initial_state(m, q.device)  # -inf: no sink here
        # -- key tiles last to first; the running max includes the tile it scales
        for j0 in reversed(range(0, sk, block_n)):
            j1 = min(j0 + block_n, sk)
            s, _ = tiles.scores(qs, kf[:, :, j0:j1], i0, i1, j0, j1)
            m_run = torch.maximum(m_run, s.amax(dim=-1))
            m_ref = torch.where(torch.isinf(m_run), torch.zeros_like(m_run), m_run)
            unseen = torch.isneginf(s)
            p = s.sub_(m_ref.unsqueeze(-1)).exp_()
            keep = tiles.keep(i0, i1, j0, j1, q.device)
            if keep is not None:
                p = torch.where(keep | unseen, p, -p)  # the sign marks a dropped entry the query sees
            out5[:, :, :, i0:i1, j0:j1] = p
