"""The attention-dropout mask, defined once for every backend.

The Triton kernels draw ``tl.rand(seed, offset)`` (Philox4x32, 10 rounds) per score element; this module
recomputes the same numbers with torch integer arithmetic, bit for bit, so that the torch backend, the
``S_dmask`` returned by ``return_attn_probs=True`` and the tests all see the mask the kernels used.

The mask convention: element ``(b, h, i, j)`` -- batch index b, query head h, query row i and key column j
counted within their own sequence -- is kept iff

    rand_uniform(seed, rng_offset + ((b * nheads + h) * max_seqlen_q + i) * max_seqlen_k + j) >= dropout_p

(``dropout_p`` compared as float32, like a float kernel argument), and kept probabilities are scaled by
``1 / (1 - dropout_p)``.  In the padded layout ``max_seqlen_* = seqlen_*``; in the varlen layout they are the
``max_seqlen_*`` the caller passed, so every sequence owns a disjoint block of counters.

``return_attn_probs=True`` hands the mask back inside flash_attn's ``S_dmask``: the probabilities in the form
its tests decode, a dropped entry with its sign bit set (kernels/triton/probs.py), shaped
``s_dmask_shape(...)``, its key tiles ``s_dmask_block_n(...)`` wide.

Arithmetic: unsigned 32-bit words live in int64 tensors in ``[0, 2**32)``.  Products of two words would
overflow int64, so multiplications split one factor into 16-bit halves (every partial product < 2**48).
"""

from __future__ import annotations

import torch

from flashattn.errors import FlashAttnError

__all__ = [
    "philox",
    "randint",
    "rand_uniform",
    "dropout_offsets",
    "dropout_keep_chunk",
    "dropout_keep_mask",
    "s_dmask_block_n",
    "s_dmask_shape",
]

S_DMASK_ROUND = 128  # S_dmask's rows and columns: the (max) lengths rounded up to a multiple of this


def s_dmask_shape(batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """flash_attn's S_dmask shape: ``(batch, nheads, seqlen_q, seqlen_k)`` with both lengths (the varlen
    call's max_seqlen_*) rounded up to a multiple of 128."""
    r = S_DMASK_ROUND
    return batch, nheads, -(-seqlen_q // r) * r, -(-seqlen_k // r) * r


def s_dmask_block_n(head_dim: int, is_dropout: bool, is_causal: bool, sm8x: bool = False) -> int:
    """The width of S_dmask's key tiles: flash_attn 2.x's ``_get_block_size_n`` (its forward kernels' kBlockN
    on sm80 / sm90; ``sm8x``: sm86 / sm89, which differ only for 96 < head_dim <= 128 without dropout).
    With dropout, the only case that returns S_dmask, it depends on the head dim alone."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        if sm8x:
            return 64 if (is_causal and not is_dropout) else 32
        return 32 if is_dropout else 64
    return 64

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# Philox4x32 constants (Salmon et al. 2011), as in triton/language/random.py
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
N_ROUNDS = 10
# uint_to_uniform_float's scale for 32-bit draws: the largest float32 with (2**31 - 1) * scale < 1
_UNIFORM_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)


def _mulhilo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * x`` for a 32-bit constant ``a`` and words ``x`` (x is consumed)."""
    t_hi = (x >> 16).mul_(a)  # a * x = t_hi * 2**16 + t_lo, both < 2**48
    t_lo = x.bitwise_and_(0xFFFF).mul_(a)
    lo = (t_hi & 0xFFFF).bitwise_left_shift_(16).add_(t_lo).bitwise_and_(_MASK32)
    hi = t_hi.add_(t_lo.bitwise_right_shift_(16)).bitwise_right_shift_(16)
    return hi, lo


def _as_words(c, like: torch.Tensor | None) -> torch.Tensor:
    if isinstance(c, torch.Tensor):
        return c.to(torch.int64) & _MASK32
    return torch.full_like(like, int(c) & _MASK32)


def _key(seed: int) -> tuple[int, int]:
    seed = int(seed) & _MASK64
    return seed & _MASK32, seed >> 32


def philox(seed: int, c0, c1=0, c2=0, c3=0, n_rounds: int = N_ROUNDS):
    """Philox4x32 of the counter ``(c0, c1, c2, c3)`` under key ``seed``; Triton's ``philox`` for 32-bit
    counters.

    ``seed`` is a Python int taken modulo 2**64 (the kernel casts it to uint64; negative int32/int64 seeds
    sign-extend to the same residue); its low and high words are the two key words.  Counters are int64
    tensors (or ints, broadcast to ``c0``'s shape) whose low 32 bits are used.  Returns the four output words
    as int64 tensors with values in ``[0, 2**32)``.
    """
    k0, k1 = _key(seed)
    c0 = _as_words(c0, None)
    c1, c2, c3 = (_as_words(c, c0) for c in (c1, c2, c3))
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        # c0 and c2 were consumed by _mulhilo; their successors are the high words
        c0, c2 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0), hi_a.bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


# Elements per block in randint: big enough to amortise the ~25 tensor ops of a round, small enough that the
# temporaries stay in cache (measured 2.7x faster than one pass over a million offsets).
_BLOCK = 1 << 14


def randint(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.randint(seed, offsets)`` as int64 words in ``[0, 2**32)``, shaped like ``offsets``.

    An int64 offset is split into its low and high 32-bit words (the first two counter words); int32
    offsets give a zero high word, which agrees with the int64 result for offsets in ``[0, 2**31)``.
    """
    flat = offsets.to(torch.int64).reshape(-1)
    out = torch.empty_like(flat)
    for i in range(0, flat.numel(), _BLOCK):
        o = flat[i : i + _BLOCK]
        out[i : i + _BLOCK] = philox(seed, o & _MASK32, (o >> 32) & _MASK32)[0]
    return out.view(offsets.shape)


def rand_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offsets)``: float32 uniform in ``[0, 1)``, bit-identical to Triton's."""
    x = randint(seed, offsets)
    # the word read as int32, negatives folded onto [0, 2**31) by x -> -x - 1
    x = torch.where(x >= 1 << 31, _MASK32 - x, x)
    return x.to(torch.float32) * _UNIFORM_SCALE.to(x.device)


def _check_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise FlashAttnError(f"dropout_p={dropout_p}; expected 0 <= dropout_p < 1")


def dropout_offsets(
    rng_offset: int,
    batch_idx: torch.Tensor,
    nheads: int,
    rows: torch.Tensor,
    cols: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> torch.Tensor:
    """Philox offsets ``(len(batch_idx), nheads, len(rows), len(cols))`` int64 of the mask convention."""
    dev = rows.device
    b = batch_idx.to(device=dev, dtype=torch.int64).view(-1, 1, 1, 1)
    h = torch.arange(nheads, device=dev, dtype=torch.int64).view(1, -1, 1, 1)
    i = rows.to(torch.int64).view(1, 1, -1, 1)
    j = cols.to(torch.int64).view(1, 1, 1, -1)
    return rng_offset + ((b * nheads + h) * max_seqlen_q + i) * max_seqlen_k + j


def dropout_keep_chunk(
    seed: int,
    rng_offset: int,
    batch_idx,
    nheads: int,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    dropout_p: float,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    device=None,
) -> torch.Tensor:
    """Keep-mask of rows ``[i0, i1)`` x columns ``[j0, j1)`` for the sequences ``batch_idx``.

    ``batch_idx``: an int or a sequence/tensor of batch indices.  Returns bool
    ``(len(batch_idx), nheads, i1 - i0, j1 - j0)``, True = keep.
    """
    _check_p(dropout_p)
    batch_idx = torch.as_tensor(batch_idx, dtype=torch.int64, device=device).reshape(-1)
    rows = torch.arange(i0, i1, device=device)
    cols = torch.arange(j0, j1, device=device)
    offs = dropout_offsets(rng_offset, batch_idx, nheads, rows, cols, max_seqlen_q, max_seqlen_k)
    # compared in float32, as the kernels compare against their float32 dropout_p argument
    return rand_uniform(seed, offs) >= torch.tensor(dropout_p, dtype=torch.float32, device=offs.device)


def dropout_keep_mask(
    seed: int,
    rng_offset: int,
    batch: int,
    nheads: int,
    seqlen_q: int,
    seqlen_k: int,
    dropout_p: float,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    device=None,
) -> torch.Tensor:
    """The whole keep-mask, bool ``(batch, nheads, seqlen_q, seqlen_k)``, True = keep.

    ``max_seqlen_*`` default to ``seqlen_*`` (padded layout).  For varlen calls pass the call's
    ``max_seqlen_*`` and ``seqlen_* = max_seqlen_*``; sequence b's mask is then ``[b, :, :len_q, :len_k]``.
    """
    mq = seqlen_q if max_seqlen_q is None else max_seqlen_q
    mk = seqlen_k if max_seqlen_k is None else max_seqlen_k
    if seqlen_q > mq or seqlen_k > mk:
        raise FlashAttnError(
            f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k} exceed max_seqlen_q={mq}, max_seqlen_k={mk}; "
            f"the counters of neighbouring rows would overlap"
        )
    return dropout_keep_chunk(
        seed, rng_offset, range(batch), nheads, 0, seqlen_q, 0, seqlen_k, dropout_p,
        max_seqlen_q=mq, max_seqlen_k=mk, device=device,
    )
