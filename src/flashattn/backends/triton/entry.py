"""The Triton backend's entry points, one per op: the launchers (allocate outputs, pick the route, launch).
Same signatures as flashattn.backends.torch.entry (kvcache_prepare / kvcache_plan: the prepared launches of
flashattn.kvcache and flashattn.decode_plan). Importing this module imports the kernels; under the
interpreter (TRITON_INTERPRET=1) it also makes the interpreter's FP8 casts round as the GPU's do
(interpreter.py)."""

from flashattn import config
from flashattn.backends.triton.attention import (
    attention_backward,
    attention_forward,
    attention_forward_fp8,
)
from flashattn.backends.triton.block_sparse import block_sparse_backward, block_sparse_forward
from flashattn.backends.triton.decode import kvcache_forward
from flashattn.backends.triton.decode import plan_route as kvcache_plan
from flashattn.backends.triton.decode import prepare as kvcache_prepare
from flashattn.backends.triton.merge import merge_partials
from flashattn.backends.triton.probs import attention_probs
from flashattn.backends.triton.quantize import quantize_fp8

if config.INTERPRET:
    from flashattn.backends.triton import interpreter

    interpreter.install()

__all__ = ["attention_backward", "attention_forward", "attention_forward_fp8", "attention_probs",
           "block_sparse_backward", "block_sparse_forward", "kvcache_forward", "kvcache_plan",
           "kvcache_prepare", "merge_partials", "quantize_fp8"]
