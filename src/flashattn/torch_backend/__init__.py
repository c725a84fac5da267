"""The pure-PyTorch backend: FlashAttention's tiled algorithm over query and key/value chunks.

Exact (fp32 accumulation, online softmax) and O(N·d) extra memory: only one score tile of
``(batch, nheads, chunk, chunk)`` exists at a time, and the backward recomputes probabilities (and the
dropout mask) from the saved LSE and the RNG seed instead of storing them.  It serves CPU users and machines
without Triton.  Same signatures and semantics as the Triton launchers in ``flashattn.ops.attention``: pure
functions, no autograd inside.

Modules: :mod:`.layouts` (the entry points; padded and varlen layouts), :mod:`.forward`, :mod:`.backward`
(one group of equal-length sequences), :mod:`.tiles` (chunk sizing; scores, masks, dropout and sink of one
tile).
"""

from flashattn.torch_backend.layouts import attention_backward, attention_forward
from flashattn.torch_backend.tiles import chunk_size

__all__ = ["attention_forward", "attention_backward", "chunk_size"]
