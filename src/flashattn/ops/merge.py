"""The merge of partial attention results: `flashattn::merge_states`, with autograd.

out = Σ_i w_i out_i / Σ_i w_i, lse = m + log Σ_i w_i with w_i = exp(lse_i − m) (flashattn.merge has the
conventions). The body calls the backend that serves the tensors: its merge_partials. The gradients are
plain torch arithmetic on the saved parts.
"""

import math

import torch
from torch import Tensor

from flashattn.backends import entry
from flashattn.ops.registry import Op


def _stacked(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    return torch.stack(outs), torch.stack(lses)


def _impl(outs: list[Tensor], lses: list[Tensor]) -> tuple[Tensor, Tensor]:
    """outs: n × (b, sq, h, d); lses: n × (b, h, sq) float32 -> out (b, sq, h, d), lse (b, h, sq)."""
    o_parts, l_parts = _stacked(outs, lses)
    return entry(o_parts).merge_partials(o_parts, l_parts, out_dtype=outs[0].dtype)


def _fake(outs, lses):
    # contiguous, as the real op allocates them
    return outs[0].new_empty(outs[0].shape), lses[0].new_empty(lses[0].shape)


def _weights(lses: list[Tensor], lse: Tensor) -> Tensor:
    """(n, b, sq, h, 1) float32: w_i / Σ w = exp(lse_i - lse), 0 for empty parts and rows."""
    l_parts = torch.stack(lses).float()
    l_parts = torch.where(torch.isposinf(l_parts), torch.full_like(l_parts, -math.inf), l_parts)
    lse_sub = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).float()
    w = torch.exp(l_parts - lse_sub)
    w = torch.where(torch.isposinf(lse), torch.zeros_like(w), w)  # a row with no key: all parts weigh 0
    return w.permute(0, 1, 3, 2).unsqueeze(-1)


def _setup_context(ctx, inputs, output):
    outs, lses = inputs
    out, lse = output
    ctx.save_for_backward(*outs, *lses, out, lse)
    ctx.n = len(outs)


def _backward(ctx, dout, dlse):
    saved = ctx.saved_tensors
    n = ctx.n
    outs, lses, out, lse = list(saved[:n]), list(saved[n : 2 * n]), saved[2 * n], saved[2 * n + 1]
    w = _weights(lses, lse)  # (n, b, sq, h, 1)
    # out = Σ w_i out_i with w_i = exp(lse_i - lse):  d out_i = w_i dout,
    # d lse_i = w_i (<dout, out_i - out> + dlse)  (∂w_j/∂lse_i = w_j (δ_ij - w_i))
    dlse_total = torch.zeros_like(w)
    if dlse is not None:
        dlse_total = dlse_total + dlse.float().transpose(1, 2).unsqueeze(-1)
    douts = []
    if dout is not None:
        dof = dout.float()
        o_parts = torch.stack(outs).float()
        safe = torch.where(w > 0, o_parts - out.float(), torch.zeros_like(o_parts))
        dlse_total = dlse_total + (dof * safe).sum(-1, keepdim=True)
        douts = [(w[i] * dof).to(outs[i].dtype) for i in range(n)]
    else:
        douts = [torch.zeros_like(o) for o in outs]
    dl = (w * dlse_total).squeeze(-1).permute(0, 1, 3, 2)  # (n, b, h, sq)
    dlses = [dl[i].to(lses[i].dtype) for i in range(n)]
    return douts, dlses


merge_states = Op("merge_states", _impl, fake=_fake)
# the differentiable inputs are lists, which an autograd.Function does not track: eager calls that need
# gradients go through the registered op
merge_states.register_autograd(_backward, _setup_context, differentiable=("outs", "lses"),
                               eager_function=False)
