"""How the split-KV decode kernel runs a KV-cache call (flash_attn_with_kvcache, DecodePlan): a pure function
from the call's `DecodeSpec` to a `DecodeRoute`, as routes.py is for the dense and varlen calls; and
`SplitForward`, the same kernel as a route of a dense forward of few query rows (routes.Spec).
This module imports neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashattn.backends.triton.configs import TileConfig, decode_programs_per_sm, decode_tiles
from flashattn.backends.triton.host import block_d
from flashattn.errors import FlashAttnError

MAX_SPLITS = 128
UNBOUNDED = 1 << 30  # a window side of -1 as the decode kernel takes it: no branch, no int32 overflow
# the most query rows a split-KV forward (SplitForward) takes: its programs pack a GQA group's rows of them
SPLIT_FORWARD_Q = 64


@dataclass(frozen=True)
class DecodeSpec:
    """A KV-cache call as routing sees it. capacity: the longest key range a sequence may have (the cache
    capacity, seqlen_cache or max_pages · page_size; a DecodePlan's max_seqlen_k); window: (left, right)
    after causal folding, -1 = unbounded; num_splits: the caller's request (0: the heuristic); sms: the
    GPU's multiprocessors."""

    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    headdim: int
    element_size: int
    paged: bool
    capacity: int
    window: tuple[int, int] = (-1, -1)
    num_splits: int = 0
    cuda: bool = True
    sms: int = 132

    @property
    def rows(self) -> int:
        """Packed query rows per (batch, kv head) program: the GQA group times seqlen_q."""
        return self.seqlen_q * (self.nheads // self.nheads_k)


@dataclass(frozen=True)
class DecodeRoute:
    """kernels/triton/decode.py: one program per (batch, kv head, split, query block); with num_splits > 1
    the last program of each (batch, kv head, query block) to finish merges the splits' partial results, in
    the same launch."""

    tiles: TileConfig
    block_m: int  # packed query rows per program (a power of two, at least 16)
    num_splits: int
    # rows the in-kernel merge takes at a time (a power of two, at most block_m): the packed rows' next power
    # of two, so that a decode step's few rows (a GQA group) merge more splits a round trip
    merge_rows: int
    kernel = "triton"


def query_block(rows: int, cap: int) -> int:
    """BLOCK_M of the split kernel for `rows` packed query rows: their next power of two, at least 16 (the
    smallest tl.dot), at most the config's cap."""
    return min(max(16, 1 << max(rows - 1, 0).bit_length()), max(16, cap))


def one_wave(programs: int, sms: int) -> bool:
    """Few enough programs that splitting the keys fills one wave of the GPU with 2 or more splits each."""
    return sms // max(programs, 1) >= 2


def num_splits_heuristic(programs: int, n_tiles: int, sms: int, per_sm: int = 1) -> int:
    """Splits of the key range, from the programs there are without splitting.

    programs: (batch, kv head, query block) programs without splitting; n_tiles: key tiles of the longest
    sequence (a split gets at least one); per_sm: programs an SM runs at once
    (configs.decode_programs_per_sm), so a wave is sms · per_sm programs. When one_wave: floor(wave /
    programs) splits (the H200 sweep found one wave of longer splits 5-21% faster than two waves at batch 1:
    fewer partial results to combine, no second-wave tail). Otherwise about two waves, ceil(2·wave /
    programs), and none from 2·wave programs on. Always within [1, min(n_tiles, 128)].
    """
    wave = sms * per_sm
    if programs >= 2 * wave:
        return 1
    splits = wave // programs if one_wave(programs, wave) else -(-2 * wave // programs)
    return max(1, min(splits, n_tiles, MAX_SPLITS))


def decode_tiles_for(spec: DecodeSpec) -> TileConfig:
    """The split kernel's tiles: a paged cache read by more programs (before splitting) than one wave allows
    takes narrower key tiles."""
    bd = block_d(spec.headdim)
    tiles = decode_tiles(bd, spec.element_size, spec.paged, spec.cuda)
    # the block_m cap does not depend on the program count: it sets the query blocks that are counted
    programs = spec.batch * spec.nheads_k * -(-spec.rows // query_block(spec.rows, tiles.block_m))
    if spec.paged and not one_wave(programs, spec.sms):
        tiles = decode_tiles(bd, spec.element_size, spec.paged, spec.cuda, many_programs=True)
    return tiles


def key_tiles(spec: DecodeSpec, capacity: int, block_n: int, block_m: int) -> int:
    """Key tiles a program of block_m packed rows walks at most when the cache holds `capacity` keys: all
    decode_route reads of the capacity (two capacities with the same count take the same route)."""
    span = capacity
    left, right = spec.window
    if spec.window != (-1, -1):
        left = UNBOUNDED if left < 0 else left
        right = UNBOUNDED if right < 0 else right
        # a query block spans at most this many query positions, each seeing left + right + 1 keys
        group = spec.nheads // spec.nheads_k
        span = min(span, left + right + min(spec.seqlen_q, -(-block_m // group) + 1))
    return max(1, -(-span // block_n) + 1)  # + 1: the span need not start on a tile


def decode_route(spec: DecodeSpec) -> DecodeRoute:
    tiles = decode_tiles_for(spec)
    block_m = query_block(spec.rows, tiles.block_m)
    m_blocks = -(-spec.rows // block_m)
    n_tiles = key_tiles(spec, spec.capacity, tiles.block_n, block_m)
    splits = spec.num_splits
    if splits <= 0:
        per_sm = decode_programs_per_sm(block_d(spec.headdim), spec.element_size)
        splits = num_splits_heuristic(spec.batch * spec.nheads_k * m_blocks, n_tiles, spec.sms, per_sm)
    merge_rows = min(block_m, 1 << max(spec.rows - 1, 0).bit_length())
    return DecodeRoute(tiles, block_m, max(1, min(splits, n_tiles)), merge_rows)


@dataclass(frozen=True)
class SplitForward:
    """kernels/triton/decode.py (flash_attn_with_kvcache's kernel) for a forward of few query rows: one
    program per (batch, KV head, split of the keys, block of packed query rows), a GQA group's rows packed
    into its query blocks (FA3's pack_gqa: K and V read once per KV head, not once per query head), the
    splits merged in the same launch. num_splits 0: decode routing's heuristic. The default route of the
    calls `split_forward_wins` picks."""

    num_splits: int = 0
    kernel = "triton"


def takes_split_forward(spec) -> bool:
    """A call (routes.Spec) the split-KV forward computes as the dense kernels do: the padded layout, at most
    SPLIT_FORWARD_Q query rows and no more than keys (every row then sees a key under any mask), d = dv up to
    256, 16-bit or float32, and no dropout, learnable sink or FP8 (options the decode kernel lacks)."""
    return (not spec.varlen and not spec.dropout and not spec.sink and not spec.out_dtype
            and spec.dtype in ("float16", "bfloat16", "float32") and spec.headdim == spec.headdim_v <= 256
            and spec.seqlen_q <= min(SPLIT_FORWARD_Q, spec.seqlen_k))


# the query rows up to which the split-KV forward beat the Gluon forward at every batch of the short suite
SPLIT_FORWARD_ALWAYS_Q = 16


def split_forward_wins(spec, sms: int = 132) -> bool:
    """Whether the split-KV forward is the default route of a call the Gluon forward also takes: at most
    SPLIT_FORWARD_ALWAYS_Q query rows, or more (up to SPLIT_FORWARD_Q) where the Gluon forward's (batch,
    head) tiles leave SMs idle (b · h < sms). H100, the short suite (h32 d128 causal, 8 or 1 KV heads, 4K and
    32K keys, benchmarks/results/2026-12-06-short-h100), split over Gluon TFLOP/s: 1-16 rows 1.5-11x at
    batch 1 and 8; 64 rows 1.4-1.9x at batch 1 (32 tiles), 0.5-0.6x at batch 8 (256 tiles)."""
    return takes_split_forward(spec) and (spec.seqlen_q <= SPLIT_FORWARD_ALWAYS_Q
                                          or spec.batch * spec.nheads < sms)


def split_forward_route(spec) -> SplitForward:
    """The split-KV forward's route for a spec it takes (takes_split_forward)."""
    if not takes_split_forward(spec):
        raise FlashAttnError(f"the split-KV forward takes the padded layout at seqlen_q <= "
                             f"{SPLIT_FORWARD_Q} and <= seqlen_k, d = dv <= 256, 16-bit or float32, no "
                             f"dropout, sink or FP8; not seqlen_q {spec.seqlen_q}, seqlen_k {spec.seqlen_k}, "
                             f"d {spec.headdim}, dv {spec.headdim_v}, {spec.dtype}, varlen={spec.varlen}, "
                             f"dropout={spec.dropout}, sink={spec.sink}")
    return SplitForward()
