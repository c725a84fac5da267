"""The running float32 (out, lse) accumulator of the ring, and the sink folded in once at the end.

The merge is design.md's rule (the one ``flashattn.merge_attention_states`` implements), written in place for
two parts so that the accumulator is never copied: with ``lse = log(e^{lse_a} + e^{lse_b})``,
``out = e^{lse_a − lse}·out_a + e^{lse_b − lse}·out_b``. Everything is float32: a partial comes out of the
kernels in the inputs' dtype, but it is rounded once and weighted, never accumulated in 16 bits (merging in
bf16 is what loses precision step after step).

Layouts: out ``(..., rows, h, d)`` with lse ``(..., h, rows)``: padded ``(b, s, h, d)`` / ``(b, h, s)`` and
varlen ``(total, h, d)`` / ``(h, total)`` alike. ``−inf`` marks an empty row (a partial that saw no key).
"""

from __future__ import annotations

import math

import torch


def _rows_last(lse):
    """lse (..., h, rows) as (..., rows, h, 1), matching out (..., rows, h, d)."""
    return lse.transpose(-1, -2).unsqueeze(-1)


def merge_into(acc_out, acc_lse, out, lse) -> None:
    """acc ← merge(acc, part), in place on float32 views. ``lse`` of the part uses −inf for empty rows."""
    new = torch.logaddexp(acc_lse, lse)  # -inf where both are empty
    ref = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_acc = _rows_last(torch.exp(acc_lse - ref))
    w_part = _rows_last(torch.exp(lse - ref))
    acc_out.mul_(w_acc).add_(out.float() * w_part)
    acc_lse.copy_(new)


def finalize(acc_out, acc_lse, sink):
    """The final float32 out and lse from the merged partials, the sink entering exactly once.

    A sink is a logit with no value: ``lse = log(e^{lse_keys} + e^{sink_h})`` and
    ``out = out_keys·e^{lse_keys − lse}``. A row that saw no key gets out 0 and lse = sink, or lse = +inf
    without a sink (flash_attn's convention).

    Args:
        acc_out: float32 ``(..., rows, h, d)``; acc_lse: float32 ``(..., h, rows)`` (−inf = no key).
        sink: None or ``(h,)``.
    """
    if sink is None:
        lse = acc_lse.masked_fill(torch.isneginf(acc_lse), math.inf)
        return acc_out, lse
    s = sink.float().view(-1, 1)  # (h, 1) broadcasts against (..., h, rows)
    lse = torch.logaddexp(acc_lse, s.expand_as(acc_lse))
    out = acc_out * _rows_last(torch.exp(acc_lse - lse))
    return out, lse


def sink_grad(dout, out32, lse, sink):
    """d sink_h = −Σ_rows e^{sink_h − lse}·D with ``D = rowsum(dout ∘ out)`` (the final out, float32): the
    sink's probability times the softmax Jacobian's row term, over this rank's rows only.

    Args: dout ``(..., rows, h, d)``; out32 float32 like it; lse ``(..., h, rows)`` final; sink ``(h,)``.
    Returns float32 ``(h,)``.
    """
    delta = (dout.float() * out32).sum(-1)  # (..., rows, h)
    p_sink = torch.exp(sink.float().view(-1, 1) - lse).transpose(-1, -2)  # (..., rows, h); 0 for +inf lse
    contrib = -(p_sink * delta)
    return contrib.reshape(-1, contrib.shape[-1]).sum(0)
