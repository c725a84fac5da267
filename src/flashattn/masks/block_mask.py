"""BlockMask: which (query block, key block) tiles attention visits, and the element mask inside the rest."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import torch

from flashattn.errors import FlashAttnError

from . import _patterns as P
from ._kernel import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockMaskKernelTensors,
    MaskRule,
    _check_lists,
    kernel_tensors,
    unpack_bits,
)

_MIN_BLOCK, _MAX_BLOCK = 16, 256


def _block_size(block_size) -> tuple[int, int]:
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else tuple(block_size)
    if len(pair) != 2:
        raise FlashAttnError(f"block_size must be an int or a pair (block_m, block_n), got {block_size!r}")
    for name, x in zip(("block_m", "block_n"), pair, strict=True):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < _MIN_BLOCK or x > _MAX_BLOCK \
                or x & (x - 1):
            raise FlashAttnError(
                f"block_size {name} is {x!r} in {block_size!r}; expected a power of two in "
                f"[{_MIN_BLOCK}, {_MAX_BLOCK}] (64, 128 and 256 are the kernels' tile sizes)"
            )
    return int(pair[0]), int(pair[1])


def _length(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise FlashAttnError(f"{name} must be an int >= 1, got {n!r}")
    return int(n)


def _window_side(name: str, w) -> int | None:
    if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < -1:
        raise FlashAttnError(f"{name} must be an int >= -1 (-1 means unbounded), got {w!r}")
    return None if w < 0 else int(w)


def _device(device, *tensors) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _regrid(flags: torch.Tensor, axis: int, old: int, new: int, count: int) -> torch.Tensor:
    """All-of pooling (coarser blocks) or repetition (finer blocks) of a bool block grid along axis."""
    if new == old:
        return flags
    if new < old:
        return flags.repeat_interleave(old // new, dim=axis).narrow(axis, 0, count)
    f = new // old
    pad = count * f - flags.shape[axis]
    if pad > 0:  # past-the-end blocks hold nothing, so they must not veto "all"
        shape = list(flags.shape)
        shape[axis] = pad
        flags = torch.cat([flags, flags.new_ones(shape)], dim=axis)
    flags = flags.narrow(axis, 0, count * f)
    return flags.unflatten(axis, (count, f)).all(axis + 1)


class _Density(float):
    """BlockMask.density: the block density as a float, and callable as density(level) (its former form)."""

    def __new__(cls, value: float, measure: Callable[[str], float]):
        obj = super().__new__(cls, value)
        obj._measure = measure
        return obj

    def __call__(self, level: str = "block") -> float:
        return float(self) if level == "block" else self._measure(level)


class BlockMask:
    """A block-sparse attention mask: per (batch or 1, head or 1), which key blocks each query block visits.

    Every (query block m, key block n) tile of size block_size = (block_m, block_n) is empty (skipped),
    full (every query of the block sees every key of it: no element mask) or partial (an element mask,
    stored as bits, applies). Query i sees key j iff the mask says so; keys j >= seqlen_k and rows
    i >= seqlen_q never take part. Causal masks are aligned to the bottom-right corner like everywhere in
    flashattn: query i sees key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:

        1 1 1 1 0
        1 1 1 1 1

    Build one with the constructors (causal, sliding_window, local_global, strided, document, tree,
    from_dense, from_mask_mod, from_blocks, from_kv_blocks, from_flex) and combine them with & (both allow)
    and | (either allows), exactly at element level. to_dense() and density are for inspection;
    to_kernel_tensors(device) gives the per-block lists the kernels iterate over (see
    BlockMaskKernelTensors for the exact layout).

    Shape: (B, H, seqlen_q, seqlen_k), B and H either 1 (the same mask for every batch element / head) or
    the attention call's batch / number of query heads.
    """

    def __init__(self, state, part_index, part_bits, seqlen_q: int, seqlen_k: int, block_size,
                 rule: MaskRule | None = None):
        # the canonical form (use the constructors): state int8 (B, H, Mq, Nk) of EMPTY / PARTIAL / FULL,
        # part_index int32 (B, H, Mq, Nk) = row of part_bits (P, block_m, block_n // 8) or -1; rule: the
        # element predicate in closed form (causal / window / local + global), for the Triton kernels
        self._rule = rule
        self._state = state
        self._part_index = part_index
        self._part_bits = part_bits
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.block_size = _block_size(block_size)
        self._kernel_cache: dict[str, BlockMaskKernelTensors] = {}

    # -- geometry
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (*self._state.shape[:2], self.seqlen_q, self.seqlen_k)

    @property
    def n_qblocks(self) -> int:
        return self._state.shape[2]

    @property
    def n_kblocks(self) -> int:
        return self._state.shape[3]

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def block_state(self) -> torch.Tensor:
        """int8 (B, H, n_qblocks, n_kblocks): 0 empty, 1 partial, 2 full (a copy)."""
        return self._state.clone()

    def _geometry(self, block_size=None) -> P.Geometry:
        bm, bn = self.block_size if block_size is None else block_size
        return P.Geometry(self.seqlen_q, self.seqlen_k, bm, bn, self.device)

    @classmethod
    def _build(cls, pattern: P.Pattern, seqlen_q, seqlen_k, block_size, device, batch=1, heads=1,
               rule: MaskRule | None = None):
        bm, bn = _block_size(block_size)
        g = P.Geometry(_length("seqlen_q", seqlen_q), _length("seqlen_k", seqlen_k), bm, bn,
                       torch.device(device))
        return cls(*P.materialize(pattern, g, batch, heads), g.seqlen_q, g.seqlen_k, (bm, bn), rule)

    # -- constructors
    @classmethod
    def full(cls, seqlen_q: int, seqlen_k: int | None = None, block_size=(128, 128),
             device=None) -> BlockMask:
        """Every query sees every key (dense attention as a block mask); seqlen_k defaults to seqlen_q."""
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        return cls._build(P.band(0, None, None), seqlen_q, seqlen_k, block_size, _device(device),
                          rule=MaskRule(0, -1, -1))

    @classmethod
    def causal(cls, seqlen_q: int, seqlen_k: int | None = None, block_size=(128, 128),
               device=None) -> BlockMask:
        """Query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned); seqlen_k defaults to
        seqlen_q (self-attention, as local_global's single length)."""
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        diag = _length("seqlen_k", seqlen_k) - _length("seqlen_q", seqlen_q)
        return cls._build(P.band(diag, None, 0), seqlen_q, seqlen_k, block_size, _device(device),
                          rule=MaskRule(diag, -1, 0))

    @classmethod
    def sliding_window(cls, seqlen_q: int, seqlen_k: int, window=(-1, -1), causal: bool = False,
                       block_size=(128, 128), device=None) -> BlockMask:
        """Query i sees keys [i + sk - sq - left, i + sk - sq + right] (window = (left, right), -1 means
        unbounded on that side), intersected with the causal mask when causal=True (right becomes 0)."""
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise FlashAttnError(f"window must be a pair (left, right), got {window!r}")
        left, right = _window_side("window left", window[0]), _window_side("window right", window[1])
        if causal:
            right = 0 if right is None else min(right, 0)
        diag = _length("seqlen_k", seqlen_k) - _length("seqlen_q", seqlen_q)
        rule = MaskRule(diag, -1 if left is None else left, -1 if right is None else right)
        return cls._build(P.band(diag, left, right), seqlen_q, seqlen_k, block_size, _device(device),
                          rule=rule)

    @classmethod
    def local_global(cls, seqlen: int, window, global_tokens: int, causal: bool = False,
                     block_size=(128, 128), device=None) -> BlockMask:
        """Local + global attention (self-attention, seqlen_q = seqlen_k = seqlen): query i sees the keys
        within the window, (left, right) or one int w for (w, w), plus the first global_tokens keys, and the
        first global_tokens queries see every key. causal=True then keeps only keys j <= i."""
        if isinstance(window, numbers.Integral) and not isinstance(window, bool):
            window = (window, window)
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise FlashAttnError(f"window must be an int or a pair (left, right), got {window!r}")
        left, right = _window_side("window left", window[0]), _window_side("window right", window[1])
        g = global_tokens
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0:
            raise FlashAttnError(f"global_tokens must be an int >= 0, got {global_tokens!r}")
        pattern = P.band(0, left, right) | P.key_prefix(g) | P.query_prefix(g)
        if causal:
            pattern = pattern & P.band(0, None, 0)
            # (band | globals) & causal = (band & causal) | (globals & causal)
            right = 0 if right is None else min(right, 0)
        rule = MaskRule(0, -1 if left is None else left, -1 if right is None else right, g, causal)
        return cls._build(pattern, seqlen, seqlen, block_size, _device(device), rule=rule)

    @classmethod
    def strided(cls, seqlen: int, stride: int, causal: bool = True, block_size=(128, 128),
                device=None) -> BlockMask:
        """Sparse Transformer's strided pattern (Child et al. 2019), both heads' patterns in one mask: query
        i sees the keys j with |i - j| < stride and those with i - j a multiple of stride; causal keeps
        j <= i."""
        if isinstance(stride, bool) or not isinstance(stride, numbers.Integral) or stride < 1:
            raise FlashAttnError(f"stride must be an int >= 1, got {stride!r}")
        local = P.band(0, stride - 1, 0 if causal else stride - 1)
        pattern = local | P.diagonals(stride)
        if causal:
            pattern = pattern & P.band(0, None, 0)
        return cls._build(pattern, seqlen, seqlen, block_size, _device(device))

    @classmethod
    def document(cls, cu_seqlens=None, *, document_ids=None, causal: bool = False, block_size=(128, 128),
                 device=None) -> BlockMask:
        """Packed documents (self-attention over the concatenation): no attention across documents.

        Give either cu_seqlens, (n_docs + 1,) ints starting at 0, non-decreasing (the varlen convention), or
        document_ids, (seqlen,) ints, one per token (tokens with equal ids see each other, whatever their
        order). causal=True keeps only keys j <= i (inside a document that is causal attention).
        """
        if (cu_seqlens is None) == (document_ids is None):
            raise FlashAttnError("document() takes exactly one of cu_seqlens and document_ids")
        if cu_seqlens is not None:
            cu = torch.as_tensor(cu_seqlens)
            if cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
                raise FlashAttnError(
                    f"cu_seqlens must be a 1-D integer tensor (n_docs + 1,) with n_docs >= 1, got "
                    f"{cu.dtype} {tuple(cu.shape)}")
            cu = cu.long()
            lengths = cu[1:] - cu[:-1]
            if int(cu[0]) != 0 or bool((lengths < 0).any()) or int(cu[-1]) < 1:
                raise FlashAttnError(
                    f"cu_seqlens must start at 0, be non-decreasing and end at the total length >= 1, got "
                    f"{cu.tolist() if cu.numel() <= 16 else cu}")
            ids = torch.repeat_interleave(torch.arange(lengths.shape[0], device=cu.device), lengths)
        else:
            ids = torch.as_tensor(document_ids)
            if ids.dim() != 1 or ids.shape[0] < 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise FlashAttnError(
                    f"document_ids must be a 1-D integer tensor (seqlen,), got {ids.dtype} "
                    f"{tuple(ids.shape)}")
            ids = ids.long()
        dev = _device(device, cu_seqlens, document_ids)
        ids = ids.to(dev)
        pattern = P.documents(ids)
        if causal:
            pattern = pattern & P.band(0, None, 0)
        n = ids.shape[0]
        return cls._build(pattern, n, n, block_size, dev)

    @classmethod
    def tree(cls, parents, prefix_len: int, block_size=(128, 128), device=None) -> BlockMask:
        """Tree attention for speculative decoding: T draft tokens in a tree, appended after prefix_len
        tokens already in the cache. Queries are the T tree tokens (seqlen_q = T), keys the prefix and the
        tree (seqlen_k = prefix_len + T); tree token i sees the whole prefix and itself and its ancestors.

        parents: T ints, parents[i] in [-1, i): the tree index of token i's parent, -1 for a root (a forest
        is allowed). Tokens are in topological order, so this is also causal in the bottom-right sense.
        """
        par = torch.as_tensor(parents)
        if par.dim() != 1 or par.shape[0] < 1 or par.dtype.is_floating_point or par.dtype == torch.bool:
            raise FlashAttnError(
                f"parents must be a 1-D integer sequence of length >= 1, got {tuple(par.shape)}")
        par = par.long()
        t = par.shape[0]
        bad = (par < -1) | (par >= torch.arange(t, device=par.device))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise FlashAttnError(
                f"parents[{i}] is {int(par[i])}; expected -1 (a root) or a parent index in [0, {i}) "
                f"(tokens in topological order)")
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, numbers.Integral) or prefix_len < 0:
            raise FlashAttnError(f"prefix_len must be an int >= 0, got {prefix_len!r}")
        dev = _device(device, par)
        par = par.to(dev)
        rows = torch.arange(t, device=dev)
        anc = torch.eye(t, dtype=torch.bool, device=dev)
        up = par.clone()
        while bool((up >= 0).any()):  # pointer jumping, one tree level per step
            ok = up >= 0
            anc[rows[ok], up[ok]] = True
            up = torch.where(ok, par[up.clamp(min=0)], -1)
        return cls._build(P.tree(anc, int(prefix_len)), t, int(prefix_len) + t, block_size, dev)

    @classmethod
    def from_mask_mod(cls, mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      block_size=(128, 128), device=None) -> BlockMask:
        """From a FlexAttention-style mask_mod(b, h, q_idx, kv_idx) -> bool (True = visible).

        The mask_mod is called with broadcasting int64 index tensors (not vmapped scalars), a batch of
        blocks at a time, so memory stays bounded; element-wise tensor code (comparisons, &, |, indexing
        tensors with the indices) works unchanged. B / H None mean 1: the same mask for every batch element
        / head (mask_mod then sees b = 0 / h = 0).
        """
        if not callable(mask_mod):
            raise FlashAttnError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {mask_mod!r}")
        b = 1 if B is None else _length("B", B)
        h = 1 if H is None else _length("H", H)
        return cls._build(P.opaque(mask_mod), Q_LEN, KV_LEN, block_size, _device(device), b, h)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_size=(128, 128)) -> BlockMask:
        """From a bool mask (seqlen_q, seqlen_k) or (B, H, seqlen_q, seqlen_k), True = visible; B and H may
        be 1 (broadcast). On the mask's device."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise FlashAttnError(
                f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4:
            raise FlashAttnError(
                f"mask must be (seqlen_q, seqlen_k) or (B, H, seqlen_q, seqlen_k), got shape "
                f"{tuple(mask.shape)}; add the missing dim with mask[None] or mask[:, None]")
        nb, nh, sq, sk = mask.shape

        def lookup(b, h, i, j):
            return mask[b, h, i.clamp(max=sq - 1), j.clamp(max=sk - 1)]

        return cls._build(P.opaque(lookup), sq, sk, block_size, mask.device, nb, nh)

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, seqlen_q: int, seqlen_k: int, block_size=(128, 128)):
        """From a bool block grid (n_qblocks, n_kblocks) or (B, H, n_qblocks, n_kblocks): every query of
        block m sees every key of block n where blocks[..., m, n] (keys past seqlen_k excepted)."""
        bm, bn = _block_size(block_size)
        if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.bool:
            raise FlashAttnError("blocks must be a bool tensor (n_qblocks, n_kblocks) or (B, H, n_qblocks, "
                            "n_kblocks)")
        if blocks.dim() == 2:
            blocks = blocks[None, None]
        mq, nk = -(-_length("seqlen_q", seqlen_q) // bm), -(-_length("seqlen_k", seqlen_k) // bn)
        if blocks.dim() != 4 or tuple(blocks.shape[2:]) != (mq, nk):
            raise FlashAttnError(
                f"blocks has shape {tuple(blocks.shape)}; expected (..., {mq}, {nk}) = (ceil(seqlen_q / "
                f"block_m), ceil(seqlen_k / block_n)) for seqlens ({seqlen_q}, {seqlen_k}) and block_size "
                f"{(bm, bn)}")
        pattern = P.listed(blocks, blocks, lambda b, h, i, j: torch.ones((), dtype=torch.bool))
        return cls._build(pattern, seqlen_q, seqlen_k, (bm, bn), blocks.device, *blocks.shape[:2])

    @classmethod
    def from_kv_blocks(cls, kv_num, kv_idx, full_kv_num=None, full_kv_idx=None, *, seqlen_q: int,
                       seqlen_k: int, block_size=(128, 128), mask_mod: Callable | None = None) -> BlockMask:
        """From per-query-block lists, FlexAttention's convention: kv_num (B, H, n_qblocks) and kv_idx
        (B, H, n_qblocks, L) list the partial blocks (mask_mod decides their elements; None: all visible),
        full_kv_num / full_kv_idx the full ones. Each list must be sorted strictly ascending within its num;
        a block may not be both full and partial."""
        bm, bn = _block_size(block_size)
        mq, nk = -(-_length("seqlen_q", seqlen_q) // bm), -(-_length("seqlen_k", seqlen_k) // bn)
        lead = tuple(kv_num.shape[:-1]) if isinstance(kv_num, torch.Tensor) and kv_num.dim() == 3 else None
        if lead is None:
            raise FlashAttnError(
                f"kv_num must be a (B, H, n_qblocks) integer tensor, got {getattr(kv_num, 'shape', kv_num)}")
        part = _check_lists("kv_num", kv_num, "kv_idx", kv_idx, mq, nk, lead)
        full = torch.zeros_like(part)
        if (full_kv_num is None) != (full_kv_idx is None):
            raise FlashAttnError("give both full_kv_num and full_kv_idx, or neither")
        if full_kv_num is not None:
            full = _check_lists("full_kv_num", full_kv_num, "full_kv_idx", full_kv_idx, mq, nk, lead)
            both = full & part
            if both.any():
                where = tuple(both.nonzero()[0].tolist())
                raise FlashAttnError(
                    f"block (b, h, m, n) = {where} is listed both in kv_idx (partial) and full_kv_idx; a "
                    f"block is either full or partial")
        pred = mask_mod if mask_mod is not None else (lambda b, h, i, j: torch.ones((), dtype=torch.bool))
        return cls._build(P.listed(full, full | part, pred), seqlen_q, seqlen_k, (bm, bn), kv_num.device,
                          *lead)

    @classmethod
    def from_flex(cls, flex_mask) -> BlockMask:
        """From a torch.nn.attention.flex_attention.BlockMask (its lists, block size and mask_mod)."""
        bs = flex_mask.BLOCK_SIZE
        sq, sk = flex_mask.seq_lengths
        return cls.from_kv_blocks(
            flex_mask.kv_num_blocks, flex_mask.kv_indices, flex_mask.full_kv_num_blocks,
            flex_mask.full_kv_indices, seqlen_q=sq, seqlen_k=sk, block_size=bs, mask_mod=flex_mask.mask_mod)

    # -- element lookup: the mask as a predicate, for combining and re-blocking
    def _lookup(self, b, h, i, j):
        nb, nh, mq, nk = self._state.shape
        bm, bn = self.block_size
        b = b.clamp(max=nb - 1) if nb > 1 else torch.zeros_like(b)
        h = h.clamp(max=nh - 1) if nh > 1 else torch.zeros_like(h)
        m, n = (i // bm).clamp(0, mq - 1), (j // bn).clamp(0, nk - 1)
        st = self._state[b, h, m, n]
        vis = st == FULL
        if self._part_bits.shape[0]:
            slot = self._part_index[b, h, m, n].clamp(min=0).long()
            c = j % bn
            byte = self._part_bits[slot, i % bm, c // 8].to(torch.int32)
            vis = vis | ((st == PARTIAL) & (((byte >> (c % 8)) & 1) == 1))
        return vis

    def _as_pattern(self) -> P.Pattern:
        state = self._state
        bm, bn = self.block_size

        def classify(g: P.Geometry):
            grids = []
            for flag in (state == FULL, state == EMPTY):
                flag = _regrid(flag, 2, bm, g.block_m, g.n_qblocks)
                grids.append(_regrid(flag, 3, bn, g.block_n, g.n_kblocks))
            return grids[0], grids[1]

        return P.Pattern(classify, self._lookup)

    def _combine(self, other, op: str) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        mine = (self.seqlen_q, self.seqlen_k, self.block_size)
        if mine != (other.seqlen_q, other.seqlen_k, other.block_size):
            raise FlashAttnError(
                f"cannot combine block masks of (seqlen_q, seqlen_k, block_size) = "
                f"{(self.seqlen_q, self.seqlen_k, self.block_size)} and "
                f"{(other.seqlen_q, other.seqlen_k, other.block_size)}; they must agree "
                f"(re-block one with with_block_size)")
        batch, heads = (torch.broadcast_shapes(self._state.shape[:2], other._state.shape[:2]))
        other = other.to(self.device)
        a, b = self._as_pattern(), other._as_pattern()
        pattern = a & b if op == "and" else a | b
        return BlockMask._build(pattern, self.seqlen_q, self.seqlen_k, self.block_size, self.device, batch,
                                heads)

    def __and__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, "and")

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._combine(other, "or")

    def with_block_size(self, block_size) -> BlockMask:
        """The same element mask over (block_m, block_n) tiles (exact, e.g. for a kernel with other tiles)."""
        bs = _block_size(block_size)
        if bs == self.block_size:
            return self
        return BlockMask._build(self._as_pattern(), self.seqlen_q, self.seqlen_k, bs, self.device,
                                *self._state.shape[:2], rule=self._rule)

    def to(self, device) -> BlockMask:
        device = torch.device(device)
        if device == self.device:
            return self
        return BlockMask(self._state.to(device), self._part_index.to(device), self._part_bits.to(device),
                         self.seqlen_q, self.seqlen_k, self.block_size, self._rule)

    # -- inspection
    def to_dense(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """bool (B, H, seqlen_q, seqlen_k), True = query i sees key j; rows=(r0, r1) gives only query rows
        [r0, r1) (B, H, r1 - r0, seqlen_k), to inspect or check a slice of a long mask."""
        r0, r1 = (0, self.seqlen_q) if rows is None else rows
        if not 0 <= r0 < r1 <= self.seqlen_q:
            raise FlashAttnError(f"rows must be (r0, r1) with 0 <= r0 < r1 <= {self.seqlen_q}, got {rows!r}")
        bm, bn = self.block_size
        m0, m1 = r0 // bm, -(-r1 // bm)
        state = self._state[:, :, m0:m1]
        nb, nh, mq, nk = state.shape
        dense = (state == FULL).repeat_interleave(bm, 2).repeat_interleave(bn, 3)
        tiles = dense.view(nb, nh, mq, bm, nk, bn).permute(0, 1, 2, 4, 3, 5)  # a view: writes reach dense
        where = (state == PARTIAL).nonzero(as_tuple=True)
        if where[0].numel():
            slots = self._part_index[:, :, m0:m1][where].long()
            tiles[where] = unpack_bits(self._part_bits[slots])
        return dense[..., r0 - m0 * bm: r1 - m0 * bm, : self.seqlen_k].contiguous()

    @property
    def density(self) -> _Density:
        """Fraction of (query block, key block) tiles visited (what the kernels pay for), averaged over the
        mask's batch and heads: a float. Called, density(level="block" | "element") gives that or the
        fraction of (query, key) pairs visible, so density() keeps working."""
        return _Density(self._density("block"), self._density)

    def _density(self, level: str = "block") -> float:
        if level == "block":
            return float((self._state != EMPTY).float().mean())
        if level != "element":
            raise FlashAttnError(f"level must be 'block' or 'element', got {level!r}")
        bm, bn = self.block_size
        rows = (torch.arange(self.n_qblocks, device=self.device) * bm).view(-1, 1)
        rows = (rows + bm).clamp(max=self.seqlen_q) - rows  # in-range rows per query block
        full = ((self._state == FULL) * rows).sum() * bn  # full tiles never hold keys past seqlen_k
        part = sum(int(unpack_bits(c).sum()) for c in self._part_bits.split(4096))
        nb, nh = self._state.shape[:2]
        return (int(full) + part) / (nb * nh * self.seqlen_q * self.seqlen_k)

    def num_blocks(self) -> dict[str, int]:
        """Counts of empty, partial and full tiles over the mask's batch and heads."""
        return {name: int((self._state == v).sum()) for name, v in
                (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def to_kernel_tensors(self, device=None) -> BlockMaskKernelTensors:
        """The per-block lists and bits the kernels read (BlockMaskKernelTensors), cached per device."""
        device = self.device if device is None else torch.device(device)
        key = str(device)
        kt = self._kernel_cache.get(key)
        if kt is None and torch.compiler.is_compiling():
            # building the lists has data-dependent sizes (the longest list): not traceable in one graph
            raise RuntimeError(
                f"BlockMask.to_kernel_tensors({key!r}) has not run yet for this mask; call it once outside "
                f"torch.compile (e.g. right after building the mask) so the compiled graph only reads it")
        if kt is None:
            own = self._kernel_cache.get(str(self.device))
            if own is None:
                own = kernel_tensors(self._state, self._part_index, self._part_bits, *self.block_size,
                                     self.seqlen_q, self.seqlen_k)
                own = dataclasses.replace(own, rule=self._rule)
                self._kernel_cache[str(self.device)] = own
            kt = own if device == self.device else own.to(device)
            self._kernel_cache[key] = kt
        return kt

    def __repr__(self) -> str:
        counts = self.num_blocks()
        return (f"BlockMask(shape={self.shape}, block_size={self.block_size}, "
                f"block density={self.density:.3f}, tiles: {counts['full']} full, {counts['partial']} "
                f"partial, {counts['empty']} empty, device={self.device})")

