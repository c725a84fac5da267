"""The pure-PyTorch backend: FlashAttention's tiled algorithm over query and key/value chunks, for every op.

Exact (fp32 accumulation, online softmax) and O(N·d) extra memory: only one score tile of
``(batch, nheads, chunk, chunk)`` exists at a time, and the backward recomputes probabilities (and the
dropout mask) from the saved LSE and the RNG seed instead of storing them. It serves CPU users and machines
without Triton. Same signatures and semantics as the Triton backend's launchers: pure functions, no autograd
inside (``entry`` lists them).

Modules: :mod:`.attention` (dense and varlen entry points), :mod:`.forward`, :mod:`.backward` (one group of
equal-length sequences), :mod:`.tiles` (chunk sizing; scores, masks, dropout and sink of one tile),
:mod:`.block_sparse`, :mod:`.decode` (KV-cache attention), :mod:`.merge` (merging partial results).
"""
