"""The torch backend's entry points, one per op: same signatures as flashattn.backends.triton.entry."""

from flashattn.backends.torch.attention import (
    attention_backward,
    attention_forward,
    attention_forward_fp8,
)
from flashattn.backends.torch.block_sparse import block_sparse_backward, block_sparse_forward
from flashattn.backends.torch.decode import kvcache_forward
from flashattn.backends.torch.decode import plan_route as kvcache_plan
from flashattn.backends.torch.decode import prepare as kvcache_prepare
from flashattn.backends.torch.merge import merge_partials
from flashattn.backends.torch.probs import attention_probs
from flashattn.backends.torch.quantize import quantize_fp8

__all__ = ["attention_backward", "attention_forward", "attention_forward_fp8", "attention_probs",
           "block_sparse_backward", "block_sparse_forward", "kvcache_forward", "kvcache_plan",
           "kvcache_prepare", "merge_partials", "quantize_fp8"]
