"""The torch backend's other route: ATen's fused CPU flash-attention kernel
(``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward), for the calls whose semantics it
has exactly. It is the same algorithm as :mod:`.forward` (key blocks, an online softmax, recomputation from
the LSE), written in C++ and threaded over (sequence, head, query block). On this machine's two cores, bf16,
N 128-512, its forward took 0.61x the chunked route's time and forward + backward 0.63x
(benchmarks/results/2026-12-08-cpu-bf16): the chunked route's ~35 torch operations a query chunk, not their
arithmetic, set the time of small problems.

It computes neither softcap, ALiBi, sinks nor dropout, takes one head dim for q, k and v, and its causal
mask is top-left (query i sees keys up to i); those calls, bands that hide anything else, CUDA tensors and
rows that see no key stay on the chunked route. So do float32 inputs: the kernel exponentiates with a fast
approximation (ATen's exp_u20), and in float32 its gradients broke the tolerance rule (3x plain PyTorch's
error) where the chunked route's did not: a fuzz case, and 16 of 113 sampled calls with logits of standard
deviation above 6 (the chunked route 3). 16-bit inputs run it on float32 copies, as the chunked route
computes them, and float64 inputs in float64. In the inputs' own 16 bits (P rounded for PV, as the GPU
kernels do) its bf16 forward ran 1.5-2.5x faster on this machine's AMX, but broke the rule too: a fuzz
case's fp16 output, and a bf16 dV one rounding off where the forward's LSE (from bf16 products) and the
backward's float32 scores differed by 2.4e-7, so that a lone key's P was not 1; on float32 copies both
pass. The kernel takes as many kv heads as query heads: where every row sees every key a GQA group's
query rows are stacked into one sequence against k and v as they are (FA3's pack_gqa; a decode step at
32/8 heads, 4K-16K keys, 0.22-0.26x the time of k and v repeated per query head), and under a causal mask,
whose band follows each row's position, k and v are repeated (against the chunked route, forward 0.58-0.96x
the time and forward + backward 0.60-1.04x at 32/8, 32/1 and 16/4 heads, N 256-1024). :func:`mask_kind`
says which route a group takes; it is a pure function of the call's spec, dtype and the group's shapes, so
the forward and the backward agree.
"""

from __future__ import annotations

import torch

from flashattn.backends.torch.tiles import Spec

FULL, CAUSAL = "full", "causal"

_forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def mask_kind(spec: Spec, sq: int, sk: int, d: int, dv: int, *, dtype: torch.dtype, device: torch.device,
              alibi: bool, sink: bool) -> str | None:
    """FULL (every query sees every key), CAUSAL (query i sees keys 0..i: the band of a bottom-right
    causal mask or window whose diagonal passes through key 0 for query 0) when the fused kernel computes
    the group exactly; None for the chunked route. dtype: q's, k's and v's (float32 stays chunked).

    Query i is aligned with key i + sk - sq (bottom-right) and sees keys in
    [i + sk - sq - left, i + sk - sq + right] (window_size = (left, right), -1: unbounded; causal: right 0).
    """
    if (device.type != "cpu" or dtype == torch.float32 or d != dv or alibi or sink or spec.softcap != 0.0
            or spec.dropout_p != 0.0 or sq == 0 or sk == 0):
        return None
    left, right = spec.window_size
    if spec.causal:
        right = 0
    offset = sk - sq
    # the left edge hides nothing when the last query's reaches key 0
    if left >= 0 and left < sk - 1:
        return None
    # the right edge: query 0's last key is offset + right
    if right < 0 or offset + right >= sk - 1:
        return FULL
    if offset + right == 0:
        return CAUSAL
    return None


def _heads_first(x, dtype, repeat: int = 1):
    """(nb, s, hx, d) -> (nb, hx * repeat, s, d) in dtype, each head repeated `repeat` times. ATen's kernel
    takes any strides but the last: it reads a row's d values as contiguous (a V laid out seqlen-contiguous
    gave wrong outputs), so such an x is copied."""
    x = x.permute(0, 2, 1, 3).to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if repeat == 1:
        return x
    nb, hx, s, d = x.shape
    return x.unsqueeze(2).expand(nb, hx, repeat, s, d).reshape(nb, hx * repeat, s, d)


def _layout(kind: str, group: int) -> tuple[int, int]:
    """(query rows stacked per kv head, kv head repeats): a GQA group's query rows stacked into one sequence
    where every row sees every key (FULL), else k and v repeated per query head (CAUSAL: the mask follows
    each row's position)."""
    return (group, 1) if kind == FULL else (1, group)


def _query_rows(x, stack: int, dtype):
    """A query-side tensor (q, out, dout: (nb, sq, h, d)) as the kernel's query operand: (nb, h, sq, d), or
    with stack > 1 (nb, h // stack, stack * sq, d), a GQA group's heads' rows one after another (FA3's
    pack_gqa)."""
    if stack == 1:
        return _heads_first(x, dtype)  # a view where the dtype matches: the kernel takes the strides
    nb, sq, h, d = x.shape
    x = x.to(dtype).unflatten(2, (h // stack, stack)).permute(0, 2, 3, 1, 4).reshape(nb, h // stack,
                                                                                      stack * sq, d)
    return x if x.stride(-1) == 1 else x.contiguous()


def _unstack(rows, out, stack: int) -> None:
    """Copies the kernel's query-side result (nb, h // stack, stack * sq, d) into out (nb, sq, h, d)."""
    nb, sq, h, d = out.shape
    stacked_rows = rows.view(nb, h // stack, stack, sq, d)
    out.unflatten(2, (h // stack, stack)).copy_(stacked_rows.permute(0, 3, 1, 2, 4))


def forward_fused(spec: Spec, kind: str, q, k, v, out, lse) -> None:
    """Writes ``out`` ``(nb, sq, h, d)`` and ``lse`` ``(nb, h, sq)`` (views into the caller's buffers) from
    q ``(nb, sq, h, d)``, k and v ``(nb, sk, hk, d)``, computed in spec.cdtype (float32 for 16-bit inputs);
    GQA as _layout says."""
    stack, repeat = _layout(kind, q.shape[2] // k.shape[2])
    c = spec.cdtype
    o, l_ = _forward_op(_query_rows(q, stack, c), _heads_first(k, c, repeat), _heads_first(v, c, repeat),
                        0.0, kind == CAUSAL, scale=spec.softmax_scale)
    _unstack(o, out, stack)
    lse.copy_(l_.reshape(lse.shape))


def backward_fused(spec: Spec, kind: str, dout, q, k, v, out, lse, dq, dk, dv) -> None:
    """Writes ``dq`` ``(nb, sq, h, d)`` and ``dk`` / ``dv`` ``(nb, sk, hk, d)``, summed over each GQA group
    (by the kernel where the group's rows are stacked, here where k and v were repeated), by ATen's backward
    in spec.cdtype (float32 for 16-bit inputs) from the forward's ``out`` and ``lse``."""
    nb, sk, hk, d = k.shape
    stack, repeat = _layout(kind, q.shape[2] // hk)
    c = spec.cdtype
    rows = lse.to(c).reshape(nb, lse.shape[1] // stack, stack * lse.shape[2])
    gq, gk, gv = _backward_op(_query_rows(dout, stack, c), _query_rows(q, stack, c),
                              _heads_first(k, c, repeat), _heads_first(v, c, repeat),
                              _query_rows(out, stack, c), rows, 0.0, kind == CAUSAL,
                              scale=spec.softmax_scale)
    _unstack(gq, dq, stack)
    for grad, g in ((dk, gk), (dv, gv)):
        if repeat > 1:
            g = g.view(nb, hk, repeat, sk, d).sum(dim=2)
        grad.copy_(g.permute(0, 2, 1, 3))
