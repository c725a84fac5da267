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
pass. :func:`mask_kind` says which route a group takes; it is a pure function of the call's spec, dtype and
the group's shapes, so the forward and the backward agree.
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


def _heads_first(x, group: int, dtype):
    """(nb, s, hx, d) -> (nb, hx * group, s, d) in dtype; each head repeated group times (GQA: ATen's kernel
    takes as many kv heads as query heads). ATen's kernel takes any strides but the last: it reads a row's d
    values as contiguous (a V laid out seqlen-contiguous gave wrong outputs), so such an x is copied."""
    x = x.permute(0, 2, 1, 3).to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if group == 1:
        return x
    nb, hx, s, d = x.shape
    return x.unsqueeze(2).expand(nb, hx, group, s, d).reshape(nb, hx * group, s, d)


def forward_fused(spec: Spec, kind: str, q, k, v, out, lse) -> None:
    """Writes ``out`` ``(nb, sq, h, d)`` and ``lse`` ``(nb, h, sq)`` (views into the caller's buffers) from
    q ``(nb, sq, h, d)``, k and v ``(nb, sk, hk, d)``, computed in spec.cdtype (float32 for 16-bit inputs)."""
    group = q.shape[2] // k.shape[2]
    c = spec.cdtype
    o, l_ = _forward_op(_heads_first(q, 1, c), _heads_first(k, group, c), _heads_first(v, group, c), 0.0,
                        kind == CAUSAL, scale=spec.softmax_scale)
    out.copy_(o.permute(0, 2, 1, 3))
    lse.copy_(l_)


def backward_fused(spec: Spec, kind: str, dout, q, k, v, out, lse, dq, dk, dv) -> None:
    """Writes ``dq`` ``(nb, sq, h, d)`` and ``dk`` / ``dv`` ``(nb, sk, hk, d)``, summed over each GQA group,
    by ATen's backward in spec.cdtype (float32 for 16-bit inputs) from the forward's ``out`` and ``lse``."""
    nb, sk, hk, d = k.shape
    group = q.shape[2] // hk
    c = spec.cdtype
    gq, gk, gv = _backward_op(_heads_first(dout, 1, c), _heads_first(q, 1, c), _heads_first(k, group, c),
                              _heads_first(v, group, c), _heads_first(out, 1, c), lse.to(c), 0.0,
                              kind == CAUSAL, scale=spec.softmax_scale)
    dq.copy_(gq.permute(0, 2, 1, 3))
    for grad, g in ((dk, gk), (dv, gv)):
        if group > 1:
            g = g.view(nb, hk, group, sk, d).sum(dim=2)
        grad.copy_(g.permute(0, 2, 1, 3))
