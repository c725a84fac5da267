"""Merging partial attention results in plain torch: the twin of flashattn.backends.triton.merge.

Layouts: partial outputs stacked as (n, b, sq, h, d), partial LSEs as (n, b, h, sq). An LSE of -inf or +inf
marks an empty partial; a row with no non-empty partial gets out 0 and lse +inf.
"""

import math

import torch


def merge_partials(o_parts, lse_parts, *, out_dtype=None):
    """The same merge in plain torch (fp32, or fp64 for fp64 inputs)."""
    cdtype = torch.float64 if o_parts.dtype == torch.float64 else torch.float32
    lse_p = lse_parts.to(cdtype)
    lse_p = torch.where(torch.isposinf(lse_p), torch.full_like(lse_p, -math.inf), lse_p)  # +inf = empty
    m = lse_p.amax(dim=0)  # (b, h, sq)
    m_sub = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(lse_p - m_sub)  # (n, b, h, sq); 0 for empty partials
    w_sum = w.sum(dim=0)
    seen = w_sum > 0
    w_safe = torch.where(seen, w_sum, torch.ones_like(w_sum))
    wt = (w / w_safe).permute(0, 1, 3, 2).unsqueeze(-1)  # (n, b, sq, h, 1)
    o = torch.where(wt > 0, o_parts.to(cdtype) * wt, torch.zeros((), dtype=cdtype, device=o_parts.device))
    out = o.sum(dim=0).to(out_dtype or o_parts.dtype)
    lse = torch.where(seen, m_sub + torch.log(w_safe), torch.full_like(m_sub, math.inf))
    return out, lse.to(torch.float32) if cdtype == torch.float32 else lse
