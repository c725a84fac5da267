"""Block-sparse attention in plain PyTorch, driven by the same kernel tensors as the Triton kernels.

The algorithm of the kernels with many tiles per step: a step takes G query blocks and S slots of their
key-block lists (full slots, then partial ones), gathers those key blocks, and updates the online softmax;
empty tiles are never touched. The backward recomputes P from the saved LSE in two passes, as the kernels
do: dQ over the query blocks' key lists, dK/dV over the key blocks' query lists (q_*_idx, q_part_slot), so
every gradient element has one writer and the result is deterministic. Extra memory is O(N·d) plus one step's
score tile (a fixed element budget), never N×N.

Same signature as the launchers it stands in for (pure functions, no autograd):
  block_sparse_forward(q, k, v, kt, *, softmax_scale, softcap, dropout_p, rng_seed, rng_offset) -> out, lse
  block_sparse_backward(dout, q, k, v, out, lse, kt, *, ...same...) -> dq, dk, dv
q (b, sq, h, d), k (b, sk, hk, d), v (b, sk, hk, dv), any strides; lse (b, h, sq) float32, +inf for rows
that see no key (their output and gradients are 0).
"""

from __future__ import annotations

import math

import torch

from flashattn.backends.torch.tiles import exp_
from flashattn.dropout import rand_uniform
from flashattn.masks._kernel import unpack_bits

# score-tile elements per step; the GPU budget keeps the Python loop short at long sequence lengths
_STEP_BUDGET = {"cpu": 1 << 22, "cuda": 1 << 26}


def _compute_dtype(*ts):
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _blocked(x, n_blocks, size, dtype, pad=0.0):
    """(b, s, heads, dim) -> (b, heads, n_blocks, size, dim) in dtype, rows past s filled with pad."""
    b, s, heads, dim = x.shape
    out = torch.full((b, heads, n_blocks * size, dim), pad, dtype=dtype, device=x.device)
    out[:, :, :s] = x.permute(0, 2, 1, 3)
    return out.view(b, heads, n_blocks, size, dim)


def _blocked_rows(x, n_blocks, size, pad):
    """(b, heads, s) -> (b, heads, n_blocks, size), rows past s filled with pad."""
    b, heads, s = x.shape
    out = torch.full((b, heads, n_blocks * size), pad, dtype=x.dtype, device=x.device)
    out[..., :s] = x
    return out.view(b, heads, n_blocks, size)


def _steps(per_block, n_rows, n_slots, device):
    """(rows per step, slots per step) so that one step's tile stays within the budget."""
    budget = _STEP_BUDGET.get(device.type, 1 << 22)
    slots = max(1, min(n_slots, budget // per_block))
    rows = max(1, min(n_rows, budget // (per_block * slots)))
    return rows, slots


class _Problem:
    def __init__(self, q, k, v, kt, softmax_scale, softcap, dropout_p, rng_seed, rng_offset):
        self.b, self.sq, self.h, self.d = q.shape
        self.sk, self.hk, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.group = self.h // self.hk
        self.kt = kt
        self.bm, self.bn = kt.block_m, kt.block_n
        self.mq, self.nk = kt.n_qblocks, kt.n_kblocks
        self.scale, self.softcap = softmax_scale, softcap
        self.dropout_p, self.seed, self.offset = dropout_p, rng_seed, rng_offset
        self.dev = q.device
        self.cdtype = _compute_dtype(q, k, v)
        self.head_of = torch.arange(self.h, device=self.dev) // self.group  # query head -> kv head
        bi = torch.arange(self.b, device=self.dev).view(-1, 1)
        self.kv_base = ((bi * self.hk + self.head_of.view(1, -1)) * self.nk).view(self.b, self.h, 1, 1)
        heads = torch.arange(self.h, device=self.dev).view(1, -1)
        self.q_base = ((bi * self.h + heads) * self.mq).view(self.b, self.h, 1, 1)

    def expand(self, t):
        """A (B|1, H|1, ...) mask tensor seen as (b, h, ...)."""
        return t.expand(self.b, self.h, *t.shape[2:])

    def scores(self, qs, ks, transposed=False):
        """Scaled, softcapped scores and tanh (softcap only): qs @ ks^T, or ks @ qs^T when transposed."""
        s = torch.matmul(ks, qs.transpose(-1, -2)) if transposed else torch.matmul(qs, ks.transpose(-1, -2))
        t = None
        if self.softcap > 0:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        return s, t

    def keep(self, rows, cols):
        """Dropout keep mask for query rows / key cols broadcast against (b, h, ...): the flashattn.dropout
        counter convention with max_seqlen = seqlen."""
        nd = max(rows.dim(), cols.dim())
        bi = torch.arange(self.b, device=self.dev).view(self.b, 1, *([1] * (nd - 2)))
        hi = torch.arange(self.h, device=self.dev).view(1, self.h, *([1] * (nd - 2)))
        counter = self.offset + ((bi * self.h + hi) * self.sq + rows) * self.sk + cols
        p = torch.tensor(self.dropout_p, dtype=torch.float32, device=self.dev)
        return rand_uniform(self.seed, counter) >= p


def _row_mask(kt, kind, m0, m1, s0, s1, num):
    """Visibility (B|1, H|1, G, bm, S * bn) of slots [s0, s1) of query blocks [m0, m1)."""
    valid = torch.arange(s0, s1, device=num.device) < num[..., m0:m1, None]  # (B, H, G, S)
    bm, bn = kt.block_m, kt.block_n
    if kind == "full":
        vis = valid[..., None, :, None].expand(*valid.shape[:3], bm, s1 - s0, bn)
    else:
        bits = unpack_bits(kt.part_bits[:, :, m0:m1, s0:s1])  # (B, H, G, S, bm, bn)
        vis = (bits & valid[..., None, None]).permute(0, 1, 2, 4, 3, 5)
    return vis.reshape(*valid.shape[:3], bm, (s1 - s0) * bn)


def _lists(kt, kind):
    if kind == "full":
        return kt.kv_full_num, kt.kv_full_idx
    return kt.kv_part_num, kt.kv_part_idx


def _kv_steps(pb, m0, m1, slots):
    """(kind, s0, s1) steps over the full then the partial lists of query blocks [m0, m1)."""
    for kind in ("full", "part"):
        num, _ = _lists(pb.kt, kind)
        longest = int(num[..., m0:m1].max())
        for s0 in range(0, longest, slots):
            yield kind, s0, min(s0 + slots, longest)


def _gather_kv(pb, kflat, vflat, kind, m0, m1, s0, s1):
    num, idx = _lists(pb.kt, kind)
    blocks = pb.expand(idx[..., m0:m1, s0:s1]).long()  # (b, h, G, S)
    flat = (pb.kv_base + blocks).reshape(-1)
    shape = (pb.b, pb.h, m1 - m0, (s1 - s0) * pb.bn)
    kg = kflat.index_select(0, flat).view(*shape, -1)
    vg = vflat.index_select(0, flat).view(*shape, -1)
    cols = (blocks.unsqueeze(-1) * pb.bn + torch.arange(pb.bn, device=pb.dev)).flatten(-2)  # (b, h, G, S·bn)
    return kg, vg, _row_mask(pb.kt, kind, m0, m1, s0, s1, num), cols


def _prepare(q, k, v, kt, **opts):
    pb = _Problem(q, k, v, kt, **opts)
    qb = _blocked(q, pb.mq, pb.bm, pb.cdtype).mul_(pb.scale)  # (b, h, Mq, bm, d), pre-scaled
    kflat = _blocked(k, pb.nk, pb.bn, pb.cdtype).view(-1, pb.bn, pb.d)  # (b·hk·Nk, bn, d)
    vflat = _blocked(v, pb.nk, pb.bn, pb.cdtype).view(-1, pb.bn, pb.dv)
    return pb, qb, kflat, vflat


def block_sparse_forward(q, k, v, kt, *, softmax_scale, softcap=0.0, dropout_p=0.0, rng_seed=0, rng_offset=0):
    pb, qb, kflat, vflat = _prepare(q, k, v, kt, softmax_scale=softmax_scale, softcap=softcap,
                                    dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset)
    b, h, bm = pb.b, pb.h, pb.bm
    out = torch.zeros(b, h, pb.mq, bm, pb.dv, dtype=pb.cdtype, device=pb.dev)
    lse = torch.full((b, h, pb.mq, bm), math.inf, dtype=pb.cdtype, device=pb.dev)
    longest = max(kt.kv_full_idx.shape[-1], kt.kv_part_idx.shape[-1])
    rows, slots = _steps(b * h * bm * pb.bn, pb.mq, longest, pb.dev)
    for m0 in range(0, pb.mq, rows):
        m1 = min(m0 + rows, pb.mq)
        qs = qb[:, :, m0:m1]  # (b, h, G, bm, d)
        m_i = torch.full((b, h, m1 - m0, bm), -math.inf, dtype=pb.cdtype, device=pb.dev)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros(b, h, m1 - m0, bm, pb.dv, dtype=pb.cdtype, device=pb.dev)
        for kind, s0, s1 in _kv_steps(pb, m0, m1, slots):
            kg, vg, vis, cols = _gather_kv(pb, kflat, vflat, kind, m0, m1, s0, s1)
            s, _ = pb.scores(qs, kg)  # (b, h, G, bm, d) x (b, h, G, d, S·bn) -> (b, h, G, bm, S·bn)
            s = s.masked_fill(~vis, -math.inf)
            # -- online softmax: rows with nothing seen yet keep m = -inf and exponentiate against 0
            m_new = torch.maximum(m_i, s.amax(-1))
            m_ref = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = torch.exp(m_i - m_ref)
            p = exp_(s - m_ref.unsqueeze(-1))
            l_i = l_i * alpha + p.sum(-1)
            if pb.dropout_p > 0:
                row_idx = ((m0 + torch.arange(m1 - m0, device=pb.dev)).view(-1, 1) * bm
                           + torch.arange(bm, device=pb.dev)).unsqueeze(-1)  # (G, bm, 1)
                p = torch.where(pb.keep(row_idx, cols.unsqueeze(-2)), p, 0.0)
            acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, vg)  # (b, h, G, bm, S·bn) x (.., S·bn, dv)
            m_i = m_new
        seen = l_i > 0
        l_safe = torch.where(seen, l_i, 1.0)
        out[:, :, m0:m1] = acc / (l_safe * (1.0 - pb.dropout_p)).unsqueeze(-1)
        lse[:, :, m0:m1] = torch.where(seen, m_i + torch.log(l_safe), math.inf)
    out = out.view(b, h, -1, pb.dv)[:, :, : pb.sq].permute(0, 2, 1, 3).to(q.dtype).contiguous()
    lse = lse.view(b, h, -1)[..., : pb.sq].to(torch.float32).contiguous()
    return out, lse


def _dq_pass(pb, qb, kflat, vflat, dob, lseb, deltab):
    b, h, bm = pb.b, pb.h, pb.bm
    dq = torch.zeros(b, h, pb.mq, bm, pb.d, dtype=pb.cdtype, device=pb.dev)
    longest = max(pb.kt.kv_full_idx.shape[-1], pb.kt.kv_part_idx.shape[-1])
    rows, slots = _steps(b * h * bm * pb.bn, pb.mq, longest, pb.dev)
    for m0 in range(0, pb.mq, rows):
        m1 = min(m0 + rows, pb.mq)
        qs, do = qb[:, :, m0:m1], dob[:, :, m0:m1]
        lse, delta = lseb[:, :, m0:m1, :, None], deltab[:, :, m0:m1, :, None]
        acc = torch.zeros(b, h, m1 - m0, bm, pb.d, dtype=pb.cdtype, device=pb.dev)
        for kind, s0, s1 in _kv_steps(pb, m0, m1, slots):
            kg, vg, vis, cols = _gather_kv(pb, kflat, vflat, kind, m0, m1, s0, s1)
            s, t = pb.scores(qs, kg)
            p = exp_(s.masked_fill(~vis, -math.inf) - lse)  # +inf LSE (empty rows) gives P = 0
            dp = torch.matmul(do, vg.transpose(-1, -2))  # (b, h, G, bm, dv) x (.., dv, S·bn)
            if pb.dropout_p > 0:
                row_idx = ((m0 + torch.arange(m1 - m0, device=pb.dev)).view(-1, 1) * bm
                           + torch.arange(bm, device=pb.dev)).unsqueeze(-1)
                dp = torch.where(pb.keep(row_idx, cols.unsqueeze(-2)), dp / (1.0 - pb.dropout_p), 0.0)
            ds = p * (dp - delta)
            if t is not None:
                ds = ds * (1.0 - t * t)  # d/dx c·tanh(x/c) = 1 - tanh²
            acc = acc + torch.matmul(ds, kg)
        dq[:, :, m0:m1] = acc * pb.scale
    return dq


def _q_lists(kt, kind):
    if kind == "full":
        return kt.q_full_num, kt.q_full_idx
    return kt.q_part_num, kt.q_part_idx


def _col_mask(pb, kind, n0, n1, s0, s1):
    """Visibility (b|B, h|H, Gk, bn, S·bm) of the query blocks in slots [s0, s1) of key blocks [n0, n1)."""
    kt = pb.kt
    num, idx = _q_lists(kt, kind)
    valid = torch.arange(s0, s1, device=num.device) < num[..., n0:n1, None]  # (B, H, Gk, S)
    bm, bn = pb.bm, pb.bn
    if kind == "full":
        vis = valid[..., None, :, None].expand(*valid.shape[:3], bn, s1 - s0, bm)
    else:
        nb, nh, mq, lp = kt.part_bits.shape[:4]
        bi = torch.arange(nb, device=num.device).view(-1, 1, 1, 1)
        hi = torch.arange(nh, device=num.device).view(1, -1, 1, 1)
        m = idx[..., n0:n1, s0:s1].long()
        slot = kt.q_part_slot[..., n0:n1, s0:s1].long()
        flat = (((bi * nh + hi) * mq + m) * lp + slot).reshape(-1)
        bits = unpack_bits(kt.part_bits.view(-1, bm, bn // 8).index_select(0, flat))
        bits = bits.view(*valid.shape, bm, bn) & valid[..., None, None]  # (B, H, Gk, S, bm, bn)
        vis = bits.permute(0, 1, 2, 5, 3, 4)  # (B, H, Gk, bn, S, bm)
    return vis.reshape(*valid.shape[:3], bn, (s1 - s0) * bm)


def _dkdv_pass(pb, qb, kflat, vflat, dob, lseb, deltab):
    b, h, bm, bn = pb.b, pb.h, pb.bm, pb.bn
    kt = pb.kt
    kb = kflat.view(b, pb.hk, pb.nk, bn, pb.d)[:, pb.head_of]  # (b, h, Nk, bn, d): a copy per query head
    vb = vflat.view(b, pb.hk, pb.nk, bn, pb.dv)[:, pb.head_of]
    qflat, doflat = qb.reshape(-1, bm, pb.d), dob.reshape(-1, bm, pb.dv)
    lseflat, deltaflat = lseb.reshape(-1, bm), deltab.reshape(-1, bm)
    dk = torch.zeros(b, h, pb.nk, bn, pb.d, dtype=pb.cdtype, device=pb.dev)
    dv = torch.zeros(b, h, pb.nk, bn, pb.dv, dtype=pb.cdtype, device=pb.dev)
    longest = max(kt.q_full_idx.shape[-1], kt.q_part_idx.shape[-1])
    cols_per, slots = _steps(b * h * bm * bn, pb.nk, longest, pb.dev)
    for n0 in range(0, pb.nk, cols_per):
        n1 = min(n0 + cols_per, pb.nk)
        ks, vs = kb[:, :, n0:n1], vb[:, :, n0:n1]  # (b, h, Gk, bn, ·)
        dk_acc = torch.zeros(b, h, n1 - n0, bn, pb.d, dtype=pb.cdtype, device=pb.dev)
        dv_acc = torch.zeros(b, h, n1 - n0, bn, pb.dv, dtype=pb.cdtype, device=pb.dev)
        for kind in ("full", "part"):
            num, idx = _q_lists(kt, kind)
            longest_here = int(num[..., n0:n1].max())
            for s0 in range(0, longest_here, slots):
                s1 = min(s0 + slots, longest_here)
                blocks = pb.expand(idx[..., n0:n1, s0:s1]).long()  # (b, h, Gk, S) query blocks
                flat = (pb.q_base + blocks).reshape(-1)
                shape = (b, h, n1 - n0, (s1 - s0) * bm)
                qg = qflat.index_select(0, flat).view(*shape, pb.d)
                dog = doflat.index_select(0, flat).view(*shape, pb.dv)
                lse = lseflat.index_select(0, flat).view(*shape).unsqueeze(-2)  # (b, h, Gk, 1, S·bm)
                delta = deltaflat.index_select(0, flat).view(*shape).unsqueeze(-2)
                vis = _col_mask(pb, kind, n0, n1, s0, s1)
                s_t, t_t = pb.scores(qg, ks, transposed=True)  # (b, h, Gk, bn, S·bm)
                p_t = exp_(s_t.masked_fill(~vis, -math.inf) - lse)
                dp_t = torch.matmul(vs, dog.transpose(-1, -2))  # (b, h, Gk, bn, dv) x (.., dv, S·bm)
                pz_t = p_t
                if pb.dropout_p > 0:
                    rows = (blocks.unsqueeze(-1) * bm + torch.arange(bm, device=pb.dev)).flatten(-2)
                    keys = ((n0 + torch.arange(n1 - n0, device=pb.dev)).view(-1, 1) * bn
                            + torch.arange(bn, device=pb.dev)).unsqueeze(-1)  # (Gk, bn, 1)
                    keep = pb.keep(rows.unsqueeze(-2), keys)
                    pz_t = torch.where(keep, p_t / (1.0 - pb.dropout_p), 0.0)
                    dp_t = torch.where(keep, dp_t / (1.0 - pb.dropout_p), 0.0)
                dv_acc = dv_acc + torch.matmul(pz_t, dog)
                ds_t = p_t * (dp_t - delta)
                if t_t is not None:
                    ds_t = ds_t * (1.0 - t_t * t_t)
                dk_acc = dk_acc + torch.matmul(ds_t, qg)  # q is pre-scaled: dK = dSᵀ (Q·scale)
        dk[:, :, n0:n1] = dk_acc
        dv[:, :, n0:n1] = dv_acc
    # GQA: the kv head's gradient is the sum over its group of query heads
    dk = dk.view(b, pb.hk, pb.group, pb.nk * bn, pb.d).sum(2)
    dv = dv.view(b, pb.hk, pb.group, pb.nk * bn, pb.dv).sum(2)
    return dk, dv


def block_sparse_backward(dout, q, k, v, out, lse, kt, *, softmax_scale, softcap=0.0, dropout_p=0.0,
                          rng_seed=0, rng_offset=0, deterministic=False):
    # deterministic: this path always is (no atomics, a fixed order of sums)
    pb, qb, kflat, vflat = _prepare(q, k, v, kt, softmax_scale=softmax_scale, softcap=softcap,
                                    dropout_p=dropout_p, rng_seed=rng_seed, rng_offset=rng_offset)
    # D_i = rowsum(dO ∘ O): the softmax-Jacobian term of each row
    delta = (dout.to(pb.cdtype) * out.to(pb.cdtype)).sum(-1).transpose(1, 2)  # (b, h, sq)
    dob = _blocked(dout, pb.mq, pb.bm, pb.cdtype)
    lseb = _blocked_rows(lse.to(pb.cdtype), pb.mq, pb.bm, math.inf)  # padded rows: P = 0
    deltab = _blocked_rows(delta, pb.mq, pb.bm, 0.0)
    dq = _dq_pass(pb, qb, kflat, vflat, dob, lseb, deltab)
    dk, dv = _dkdv_pass(pb, qb, kflat, vflat, dob, lseb, deltab)
    # empty_like: the layout the registered op's fake implementation promises (q's, k's, v's)
    dq_out, dk_out, dv_out = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dq_out.copy_(dq.view(pb.b, pb.h, -1, pb.d)[:, :, : pb.sq].permute(0, 2, 1, 3))
    dk_out.copy_(dk[:, :, : pb.sk].permute(0, 2, 1, 3))
    dv_out.copy_(dv[:, :, : pb.sk].permute(0, 2, 1, 3))
    return dq_out, dk_out, dv_out
