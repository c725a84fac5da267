"""`flex`: torch.compile(flex_attention) with a causal BlockMask."""

from __future__ import annotations

import torch

from ..case import Case
from .base import Prepared, Provider, make_leaves

# Past dynamo's default of 8 recompiles, torch.compile(flex_attention) silently falls back to an unfused path
# that materialises the scores (the anchors page saw 15 TFLOP/s instead of 450, then OOM). A sweep compiles
# once per shape, so lift the limits and make hitting them an error rather than a silent slowdown.
_RECOMPILE_LIMIT = 1000
_compiled = None


def _compiled_flex():
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
        for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 4 * _RECOMPILE_LIMIT))
        for name in ("fail_on_cache_limit_hit", "fail_on_recompile_limit_hit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, True)
        # the harness times the backward alone by replaying it on one graph (retain_graph=True), which a
        # compiled backward with donated buffers refuses; donation only saves memory, not time
        import torch._functorch.config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
        # static shapes: each shape gets its own specialised kernel, as a training run with fixed shapes would
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled_flex()
    leaves = make_leaves(q, k, v, "bhsd")
    qh, kh, vh = leaves
    block_mask = None
    if case.causal:
        offset = case.seqlen_k - case.seqlen_q  # bottom-right alignment

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(causal, None, None, case.seqlen_q, case.seqlen_k, device=q.device)
    gqa = case.nheads != case.nheads_k
    return Prepared(
        fwd=lambda: flex(qh, kh, vh, block_mask=block_mask, enable_gqa=gqa), leaves=leaves, layout="bhsd"
    )


PROVIDERS = [
    Provider("flex", _setup, "torch.compile(flex_attention), causal BlockMask from create_block_mask")
]
