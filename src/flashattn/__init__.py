"""flashattn: exact, IO-aware softmax attention with Triton kernels and the flash_attn 2.x API."""

from flashattn.block_sparse import block_sparse_attn_func
from flashattn.decode_plan import DecodePlan
from flashattn.interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from flashattn.interface_varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from flashattn.kvcache import flash_attn_with_kvcache
from flashattn.masks import BlockMask
from flashattn.merge import merge_attention_states

__all__ = [
    "BlockMask",
    "DecodePlan",
    "block_sparse_attn_func",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "merge_attention_states",
]
__version__ = "0.1.0"
