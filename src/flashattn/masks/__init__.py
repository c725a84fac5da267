"""Block-sparse attention masks: BlockMask, its constructors and combinators, the tensors the kernels read.

The built-in patterns (causal, sliding window, local + global, strided, documents, token trees) and arbitrary
FlexAttention-style mask_mods all become one representation: per (batch or 1, head or 1) and (query block,
key block) tile, empty / full / partial, with the element mask of partial tiles bit-packed. Every backend
reads that one representation (BlockMask.to_kernel_tensors); for the causal, sliding-window and local +
global masks the Triton kernels compute the partial tiles' predicate from the mask's MaskRule instead.
"""

from flashattn.masks._kernel import BlockMaskKernelTensors, MaskRule
from flashattn.masks.block_mask import BlockMask

__all__ = ["BlockMask", "BlockMaskKernelTensors", "MaskRule"]
