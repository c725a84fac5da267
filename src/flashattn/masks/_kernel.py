"""Bit packing and the per-block lists the kernels iterate over (the kernel-tensor contract).

Everything here is vectorised over the (batch, head, query block, key block) grid; nothing loops in Python
over blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from flashattn.errors import FlashAttnError

EMPTY, PARTIAL, FULL = 0, 1, 2

# bit j % 8 of byte j // 8 is key j of a block: the weights that pack 8 keys into one byte
_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_bits(vis: torch.Tensor) -> torch.Tensor:
    """bool (..., bn) -> uint8 (..., bn // 8); bit j % 8 of byte j // 8 is element j."""
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=vis.device)
    grouped = vis.unflatten(-1, (vis.shape[-1] // 8, 8)).to(torch.int32)
    return (grouped * w).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (..., bn // 8) -> bool (..., bn), the inverse of pack_bits."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)


def block_lists(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """num (..., rows) and idx (..., rows, max(1, max num)) int32 of the True columns of each row, ascending.

    Slots past num hold 0 (a valid block index, so a pipelined prefetch past the end reads real memory).
    """
    num = flags.sum(-1, dtype=torch.int32)
    width = max(1, int(num.max())) if num.numel() else 1
    # a stable sort of "not set" puts the set columns first, in their original (ascending) order
    order = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    if order.shape[-1] < width:  # fewer columns than one slot: only when there are no columns at all
        order = torch.zeros((*flags.shape[:-1], width), dtype=order.dtype, device=flags.device)
    slot = torch.arange(width, device=flags.device)
    idx = torch.where(slot < num.unsqueeze(-1), order, 0).to(torch.int32)
    return num, idx.contiguous()


@dataclass(frozen=True)
class MaskRule:
    """The element predicate of a causal, sliding-window or local + global mask, in the form the Triton
    kernels evaluate for partial blocks instead of reading their bits. Query i sees key j iff

        (j >= i + diag - left, when left >= 0) and (j <= i + diag + right, when right >= 0)
        or ((j < global_tokens or i < global_tokens) and (j <= i + diag, when global_causal))

    (a window with neither side bounded sees everything). Bits are still built: every other backend and
    to_dense read them."""

    diag: int
    left: int  # -1: unbounded
    right: int  # -1: unbounded
    global_tokens: int = 0
    global_causal: bool = False

    NONE = (0, 0, 0, 0, 0, 0)  # as_list of no rule: always six ints (autograd takes an empty list apart)

    def as_list(self) -> list[int]:
        """The ints the registered ops carry (torch.library takes no dataclasses): a 1, then the fields."""
        return [1, self.diag, self.left, self.right, self.global_tokens, int(self.global_causal)]

    @classmethod
    def from_list(cls, values) -> MaskRule | None:
        """The inverse of as_list; NONE (a leading 0) is no rule."""
        has, diag, left, right, glob, causal = (int(v) for v in values)
        return cls(diag, left, right, glob, bool(causal)) if has else None


@dataclass(frozen=True)
class BlockMaskKernelTensors:
    """What the block-sparse kernels read. All tensors int32 (part_bits uint8), contiguous, on one device.

    B and H are the mask's batch and head dims, each 1 (broadcast: use stride 0) or the call's batch / nheads
    (query heads). Mq = n_qblocks = ceil(seqlen_q / block_m), Nk = n_kblocks = ceil(seqlen_k / block_n).

    Forward and dQ (per query block m, loop over key blocks):
      kv_full_num (B, H, Mq)          number of full blocks of query block m: no element predicate
      kv_full_idx (B, H, Mq, Lf)      their key-block indices, ascending in slots [0, num); 0 past num
      kv_part_num (B, H, Mq)          number of partial blocks: the element predicate applies
      kv_part_idx (B, H, Mq, Lp)      their key-block indices, ascending; 0 past num
      part_bits   (B, H, Mq, Lp, block_m, block_n // 8) uint8: the predicate of the partial block in slot s
                  of query block m: key j (0 <= j < block_n) of the block is visible to row r iff
                  (part_bits[b, h, m, s, r, j // 8] >> (j % 8)) & 1. Slots past num are all 0.
    dK/dV (per key block n, loop over query blocks):
      q_full_num (B, H, Nk), q_full_idx (B, H, Nk, Lqf)   the query blocks that see key block n fully
      q_part_num (B, H, Nk), q_part_idx (B, H, Nk, Lqp)   ... partially
      q_part_slot (B, H, Nk, Lqp)     for the partial pair (m = q_part_idx[b, h, n, t], n): the slot s of
                  part_bits that holds it, so its bits are part_bits[b, h, m, s] (no transposed copy).
    Launch order (longest processing time first: the programs with the longest block lists start first, so
    that a few heavy rows, such as local + global's global-token rows, do not finish last on an idle GPU):
      q_order (B, H, Mq)              the query blocks, by descending number of listed key blocks (ties:
                  ascending index); the forward and dQ programs take their query block from it
      k_order (B, H, Nk)              the key blocks, likewise by listed query blocks, for dK/dV
    L* = max(1, the longest list); each list is sorted strictly ascending within its num.

    Tails: bits of rows >= seqlen_q and keys >= seqlen_k are 0. A block is full iff every row < seqlen_q of
    it sees all block_n keys, so a block holding keys >= seqlen_k is never full (always partial when
    visible): full blocks may be processed with no predicate at all, and rows >= seqlen_q of a full block
    are harmless because the kernels never store them (their LSE is +inf in the backward).

    rule: the mask's MaskRule when it has one (causal, sliding_window, local_global, full): the Triton kernels
    then compute the predicate of partial blocks rather than load part_bits.
    partial_permille: the partial blocks among the visible ones over all of the mask's batch elements and
    heads, in thousandths (0 without a visible block): which kernels run the mask is routing's choice by it
    (backends/triton/sparse_routes.py).
    """

    kv_full_num: torch.Tensor
    kv_full_idx: torch.Tensor
    kv_part_num: torch.Tensor
    kv_part_idx: torch.Tensor
    part_bits: torch.Tensor
    q_full_num: torch.Tensor
    q_full_idx: torch.Tensor
    q_part_num: torch.Tensor
    q_part_idx: torch.Tensor
    q_part_slot: torch.Tensor
    q_order: torch.Tensor
    k_order: torch.Tensor
    block_m: int
    block_n: int
    seqlen_q: int
    seqlen_k: int
    rule: MaskRule | None = None
    partial_permille: int = 0

    TENSORS = (
        "kv_full_num", "kv_full_idx", "kv_part_num", "kv_part_idx", "part_bits",
        "q_full_num", "q_full_idx", "q_part_num", "q_part_idx", "q_part_slot", "q_order", "k_order",
    )

    @property
    def n_qblocks(self) -> int:
        return self.kv_full_num.shape[-1]

    @property
    def n_kblocks(self) -> int:
        return self.q_full_num.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.kv_full_num.device

    def shapes(self) -> tuple:
        """The blocks, lengths and every tensor's shape: what the kernels' scalar arguments derive from (a
        launcher's signature key for the mask)."""
        return (self.block_m, self.block_n, self.seqlen_q, self.seqlen_k,
                *(getattr(self, name).shape for name in self.TENSORS))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors in TENSORS order (how the registered ops carry them)."""
        return [getattr(self, name) for name in self.TENSORS]

    @classmethod
    def from_tensors(cls, tensors, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                     rule: MaskRule | None = None, partial_permille: int = 0):
        return cls(*tensors, block_m=block_m, block_n=block_n, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                   rule=rule, partial_permille=partial_permille)

    def to(self, device) -> BlockMaskKernelTensors:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in self.TENSORS:
            moved[name] = moved[name].to(device)
        return BlockMaskKernelTensors(**moved)


def kernel_tensors(state, part_index, part_bits, block_m, block_n, seqlen_q, seqlen_k):
    """The contract's tensors from the canonical form (block states, slot of each partial block's bits)."""
    full = state == FULL
    part = state == PARTIAL
    kv_full_num, kv_full_idx = block_lists(full)
    kv_part_num, kv_part_idx = block_lists(part)
    # part_bits of the slots: gather each partial block's bits through its index in the flat storage
    where = part_index.gather(-1, kv_part_idx.long())  # (B, H, Mq, Lp): flat index, -1 past num
    slot_ok = torch.arange(kv_part_idx.shape[-1], device=state.device) < kv_part_num.unsqueeze(-1)
    where = torch.where(slot_ok, where, -1)
    bits = torch.zeros((*where.shape, block_m, block_n // 8), dtype=torch.uint8, device=state.device)
    if part_bits.shape[0]:
        bits[slot_ok] = part_bits[where[slot_ok].long()]
    q_full_num, q_full_idx = block_lists(full.transpose(-1, -2))
    q_part_num, q_part_idx = block_lists(part.transpose(-1, -2))
    # the slot of (m, n) in row m's partial list is the number of partial blocks before n in that row
    slot_of = (part.to(torch.int32).cumsum(-1) - 1).transpose(-1, -2)  # (B, H, Nk, Mq)
    q_part_slot = slot_of.gather(-1, q_part_idx.long())
    q_slot_ok = torch.arange(q_part_idx.shape[-1], device=state.device) < q_part_num.unsqueeze(-1)
    q_part_slot = torch.where(q_slot_ok, q_part_slot, 0).to(torch.int32)
    # host values once per mask and device, as the lists' widths above already are
    n_full, n_part = int(full.sum()), int(part.sum())
    return BlockMaskKernelTensors(
        kv_full_num.contiguous(), kv_full_idx, kv_part_num.contiguous(), kv_part_idx, bits.contiguous(),
        q_full_num.contiguous(), q_full_idx, q_part_num.contiguous(), q_part_idx, q_part_slot.contiguous(),
        longest_first(kv_full_num + kv_part_num), longest_first(q_full_num + q_part_num),
        block_m, block_n, seqlen_q, seqlen_k, partial_permille=(1000 * n_part) // max(n_full + n_part, 1),
    )


def longest_first(count: torch.Tensor) -> torch.Tensor:
    """int32 (..., n): the indices of the last axis by descending count, ties in ascending index."""
    return torch.sort(-count.to(torch.int64), dim=-1, stable=True).indices.to(torch.int32).contiguous()


def _check_lists(name_num: str, num: torch.Tensor, name_idx: str, idx: torch.Tensor, rows: int, limit: int,
                 lead: tuple[int, ...]) -> torch.Tensor:
    """Validates one (num, idx) pair; returns the bool (…, rows, limit) grid of the listed blocks."""
    for name, t, nd in ((name_num, num, len(lead) + 1), (name_idx, idx, len(lead) + 2)):
        if not isinstance(t, torch.Tensor):
            raise FlashAttnError(f"{name} must be an integer tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() != nd:
            raise FlashAttnError(
                f"{name} must be an integer tensor with {nd} dims, got {t.dtype} {tuple(t.shape)}")
    if tuple(num.shape) != (*lead, rows):
        raise FlashAttnError(
            f"{name_num} has shape {tuple(num.shape)}; expected {(*lead, rows)}: {rows} = ceil(seqlen / "
            f"block size) blocks (does the block size match the one the lists were made for?)"
        )
    if tuple(idx.shape[:-1]) != (*lead, rows):
        raise FlashAttnError(f"{name_idx} has shape {tuple(idx.shape)}; expected {(*lead, rows)} + (max "
                             "blocks,)")
    num = num.long()
    idx = idx.long()
    if num.numel() and (int(num.min()) < 0 or int(num.max()) > idx.shape[-1]):
        raise FlashAttnError(
            f"{name_num} has values in [{int(num.min())}, {int(num.max())}]; expected 0 <= num <= "
            f"{idx.shape[-1]} (the slots of {name_idx})"
        )
    used = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
    vals = idx[used]
    if vals.numel() and (int(vals.min()) < 0 or int(vals.max()) >= limit):
        raise FlashAttnError(
            f"{name_idx} holds block indices in [{int(vals.min())}, {int(vals.max())}]; expected "
            f"0 <= index < {limit} (the number of key blocks)"
        )
    steps = idx[..., 1:] - idx[..., :-1]
    bad = (steps <= 0) & used[..., 1:]
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise FlashAttnError(
            f"{name_idx} is not sorted strictly ascending within its first num entries (first at index "
            f"{where}, values {idx[where].item()} then {idx[where[:-1] + (where[-1] + 1,)].item()}); "
            f"sort each row's block indices and drop duplicates"
        )
    # unused slots land in an extra column that is dropped, so they never collide with a real index
    grid = torch.zeros((*lead, rows, limit + 1), dtype=torch.bool, device=idx.device)
    grid.scatter_(-1, torch.where(used, idx, limit), True)
    return grid[..., :limit]
