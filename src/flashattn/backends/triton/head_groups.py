"""The backward of a call whose float32 dQ buffer would pass `routes.DQ_BUFFER_CAP`, by groups of heads.

The Gluon backward adds dQ into a float32 buffer as large as q (`routes.dq_buffer_bytes`): at 128K tokens
of 16 heads of 128 that is 1 GiB, which the memory target (2.2 GiB beyond the inputs for forward and
backward at that size) has no room for, and past the cap the call would take the Triton backward. Above the
cap, `attention_backward` runs the call one group of query heads at a time instead
(`routes.backward_head_groups` says how many), each on whatever route that part takes. Groups of whole KV
heads (with their query heads) give the whole call's gradients bit for bit: heads are independent, a KV
head's dK and dV summing over its own query heads only. Where a KV head's share alone passes the cap (MQA,
a few KV heads of wide groups), its query heads go in parts whose dK and dV are summed in float32. Not with
dropout: its random stream is indexed by head.
Each group writes its gradients straight into the whole call's (views of its heads) where those views suit
the kernels' stores, so that a group adds no gradient copies to the peak: at 128K tokens of 16 heads of
128, three 32 MiB tensors a group.
"""

import torch


def backward_by_head_groups(backward, groups: int, dout, q, k, v, out, lse, *, alibi_slopes=None,
                            learnable_sink=None, cu_seqlens_q=None, **options):
    """backward(dout, q, k, v, out, lse, **options) (attention_backward's signature and results) over
    `groups` equal groups of query heads, each with its KV heads: whole KV heads (their gradients copied), or
    part of one KV head's query heads (its dK and dV summed over the parts in float32): q, k, v, dout, out
    (b, s, h, d), or (total, h, d) under varlen; lse (b, h, sq), or (h, total); alibi_slopes (h,) or (b, h);
    learnable_sink (h,). Returns the whole call's dq, dk, dv and dsink."""
    axis = 1 if cu_seqlens_q is not None else 2  # the heads' axis of q, k, v, dout and out
    lse_axis = axis - 1
    heads, heads_k = q.shape[axis], k.shape[axis]
    per_kv, hn = heads // heads_k, heads // groups  # query heads a KV head, a group
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks, summed = [], None
    for i in range(groups):
        h0 = i * hn
        k0, kn = h0 // per_kv, max(hn // per_kv, 1)
        part = [t.narrow(axis, h0, hn) for t in (dout, q)] + [t.narrow(axis, k0, kn) for t in (k, v)]
        alibi = None if alibi_slopes is None else alibi_slopes.narrow(alibi_slopes.dim() - 1, h0, hn)
        sink = None if learnable_sink is None else learnable_sink.narrow(0, h0, hn)
        whole = hn >= per_kv
        views = (dq.narrow(axis, h0, hn), dk.narrow(axis, k0, kn), dv.narrow(axis, k0, kn))
        grads = views if whole and all(_storable(t) for t in views) else None
        gq, gk, gv, gsink = backward(*part, out.narrow(axis, h0, hn), lse.narrow(lse_axis, h0, hn),
                                     alibi_slopes=alibi, learnable_sink=sink, cu_seqlens_q=cu_seqlens_q,
                                     grads=grads, **options)
        if gsink is not None:
            dsinks.append(gsink)
        if grads is not None:
            continue
        views[0].copy_(gq)
        if whole:
            views[1].copy_(gk)
            views[2].copy_(gv)
            continue
        # a part of KV head k0's query heads: its dK and dV summed in float32 until the last part
        summed = (gk.float(), gv.float()) if h0 % per_kv == 0 else (summed[0].add_(gk), summed[1].add_(gv))
        if (h0 + hn) % per_kv == 0:
            dk.narrow(axis, k0, 1).copy_(summed[0])
            dv.narrow(axis, k0, 1).copy_(summed[1])
    return dq, dk, dv, torch.cat(dsinks) if dsinks else None


def _storable(t: torch.Tensor) -> bool:
    """A gradient view the kernels can write in place (a TMA store's needs): 16-byte aligned, its last dim
    contiguous, the other strides 16-byte multiples."""
    size = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(st * size % 16 == 0 for st in t.stride()[:-1]))
