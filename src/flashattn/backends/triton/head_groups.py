"""The backward of a call whose float32 dQ buffer would pass `routes.DQ_BUFFER_CAP`, by groups of KV heads.

The Gluon backward adds dQ into a float32 buffer as large as q (`routes.dq_buffer_bytes`): at 128K tokens
of 16 heads of 128 that is 1 GiB, which the memory target (2.2 GiB beyond the inputs for forward and
backward at that size) has no room for, and past the cap the call would take the Triton backward. Above the
cap, `attention_backward` runs the call one group of KV heads (with their query heads) at a time instead
(`routes.backward_head_groups` says how many), each on whatever route that part takes, and copies each
group's gradients into the whole ones. Heads are independent (a KV head's dK and dV sum over its own query
heads only), so the gradients are the whole call's. Not with dropout: its random stream is indexed by head.
"""

import torch


def backward_by_head_groups(backward, groups: int, dout, q, k, v, out, lse, *, alibi_slopes=None,
                            learnable_sink=None, cu_seqlens_q=None, **options):
    """backward(dout, q, k, v, out, lse, **options) (attention_backward's signature and results) over
    `groups` equal groups of KV heads, each with its query heads: q, k, v, dout, out (b, s, h, d), or
    (total, h, d) under varlen; lse (b, h, sq), or (h, total); alibi_slopes (h,) or (b, h); learnable_sink
    (h,). Returns the whole call's dq, dk, dv and dsink."""
    axis = 1 if cu_seqlens_q is not None else 2  # the heads' axis of q, k, v, dout and out
    lse_axis = axis - 1
    heads, heads_k = q.shape[axis], k.shape[axis]
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dsinks = []
    for i in range(groups):
        h0, hn = i * heads // groups, heads // groups
        k0, kn = i * heads_k // groups, heads_k // groups
        part = [t.narrow(axis, h0, hn) for t in (dout, q)] + [t.narrow(axis, k0, kn) for t in (k, v)]
        alibi = None if alibi_slopes is None else alibi_slopes.narrow(alibi_slopes.dim() - 1, h0, hn)
        sink = None if learnable_sink is None else learnable_sink.narrow(0, h0, hn)
        gq, gk, gv, gsink = backward(*part, out.narrow(axis, h0, hn), lse.narrow(lse_axis, h0, hn),
                                     alibi_slopes=alibi, learnable_sink=sink, cu_seqlens_q=cu_seqlens_q,
                                     **options)
        dq.narrow(axis, h0, hn).copy_(gq)
        dk.narrow(axis, k0, kn).copy_(gk)
        dv.narrow(axis, k0, kn).copy_(gv)
        if gsink is not None:
            dsinks.append(gsink)
    return dq, dk, dv, torch.cat(dsinks) if dsinks else None
