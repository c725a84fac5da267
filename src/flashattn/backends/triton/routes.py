"""Which kernel runs a call, and how: a pure function from the call's spec to a route.

A `Spec` is everything routing may look at — shapes, dtype, options, the device's kind and capability, and
whether the streamed tensors suit TMA descriptors — and a route is a frozen value naming the kernel family,
its tiles and its schedule options. The launchers (`attention.py`) take a route, or compute the default one
with these functions; the IO model, the benchmarks and the tests call the same functions or build a route
explicitly (`dataclasses.replace(route, ...)`) to time or check an alternative. Nothing here reads process
state but the expert tile overrides (`flashattn.config`), which the tile table applies.

Routes of the dense and varlen attention:
  forward:  `GluonForward` (the warp-specialised Hopper kernel, kernels/gluon/attn_fwd.py) for 16-bit calls
            with TMA-ready tensors on sm90+, d 33..256 and dv padded to the kernel's widths (dv's no wider
            than d's; 192 / 128 included), padded or varlen, with any window (causal included), softcap,
            ALiBi or sink, and no dropout; else `TritonForward` (kernels/triton/attn_fwd.py, every
            feature). FP8 inference calls take the Gluon forward's FP8 variant in the padded layout with a
            16-bit output where the H200 measured it faster (`takes_gluon_fp8_forward`), else the Triton one;
  backward: `GluonBackward` (kernels/gluon/attn_bwd.py) for the same calls, padded or varlen, at d 33..128
            beside dv <= d unless its float32 dQ buffer would pass `DQ_BUFFER_CAP` (attention_backward runs
            such a call by groups of heads under it first: head_groups.py) (deterministic, in its
            fixed-order variant, at d = dv = 64 or 128 and not with a learnable sink), at d 129..192 beside
            dv 33..128 on 128 keys a program (kernels/gluon/attn_bwd_keys.py, `GluonBackward.wide_keys`),
            and at d 193..256 beside dv padded to 128 or 256 on the wide heads' kernel
            (kernels/gluon/attn_bwd_dsplit.py, `GluonBackward.d_qk`); both deterministic too (their
            fixed-order variants; not with a learnable sink). Else `TritonBackward` (two programs: dK/dV and
            dQ).
Block-sparse calls (BlockMask): sparse_routes.py. Decode (flash_attn_with_kvcache, DecodePlan):
decode_routes.py.
This module imports neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashattn.backends.triton.configs import TileConfig, tile_config
from flashattn.backends.triton.decode_routes import SplitForward, split_forward_wins
from flashattn.backends.triton.host import block_d
from flashattn.errors import FlashAttnError

HALF_M = 64  # query rows per consumer warpgroup of the Gluon kernels
# registers per thread for the Gluon forward's 12 warps (two consumer warpgroups, the loader's): 168 x 384
# fills the 64K-register file; the partitions then take 240 / 240 / 24
MAXNREG_TWO = 168
MAXNREG_THREE = 128  # 16 warps (three consumer warpgroups and the loader's) x 128 fill the register file
# the Gluon backward's float32 dQ buffer beyond which a call does not take it: the 128K-token memory target
# (2.2 GiB beyond the inputs for forward + backward, b=1, h=16, d=128) leaves no room for a 1 GiB buffer.
# attention_backward runs such a call by groups of heads whose buffers fit (head_groups.py); what is left
# above it (dropout, a single head past the cap, an explicit route) takes the Triton backward
DQ_BUFFER_CAP = 512 << 20
# the largest float32 dQ buffer of one such group: with the group's dq, dk and dv before their copy into the
# whole gradients (half as many bytes again at d = dv, 16-bit), 160 MiB beside what the call holds anyway
DQ_GROUP_BYTES = 64 << 20
# the float32 dK and dV buffers of the Gluon backward's GQA group split, beyond which one program walks the
# whole group instead (they come on top of the dQ buffer)
SPLIT_BUFFER_CAP = 256 << 20
# bytes of streamed tiles (K/V, or Q/dO in the dK/dV role) that one group of heads may keep live in L2
# (50 MiB on the H200): interleaving every head lost 4-9% to L2 misses in the block-sparse kernels
L2_BUDGET = 16 << 20
GLUON_HEADDIMS = (64, 128, 192, 256)  # the Gluon forward's Q/K widths
GLUON_HEADDIMS_V = (64, 128, 256)  # its V and O widths: O is a register tile (a power of two)
# shared memory a block may take on the H200 (227 KiB), less room for the mbarriers and work-item slots
SMEM_BYTES = 227 * 1024 - 1024
GLUON_BWD_HEADDIMS = (64, 128)  # attn_bwd.py's d = dv
# attn_bwd_dsplit.py's (Q/K column units, dv): d 129..256 in 64-column units, dv 128 or 256; the default
# route gives width 192 to attn_bwd_keys.py (1.29x at d 192 / dv 128 on an H100), so dsplit's 192 serves the
# explicit route (`dsplit_backward_route`) of A/B timing
GLUON_BWD_WIDE = ((192, 128), (256, 128), (256, 256))
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class Spec:
    """A dense or varlen attention call as routing sees it.

    seqlen_q / seqlen_k: the padded lengths, or max_seqlen_q / max_seqlen_k for varlen; tokens_q: varlen,
    the packed query rows (q's first dim), else 0 (batch · seqlen_q); out_dtype: an FP8 call's output dtype
    ("" otherwise). window: (left, right) after causal folding (causal sets right = 0), -1 = unbounded:
    causal is the window (-1, 0). cuda: a CUDA device (else the interpreter's CPU tensors); capability: its
    (major, minor). aligned: every streamed tensor (q, k, v, and dout for the backward; an FP8 call's q and
    k, its V being laid out K-major by the launcher) has a 16-byte aligned base and strides with a
    contiguous last dim.
    """

    batch: int
    nheads: int
    nheads_k: int
    seqlen_q: int
    seqlen_k: int
    headdim: int
    headdim_v: int
    dtype: str = "bfloat16"
    varlen: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    sink: bool = False
    deterministic: bool = False
    cuda: bool = True
    capability: tuple[int, int] = (9, 0)
    aligned: bool = True
    tokens_q: int = 0
    out_dtype: str = ""
    page_size: int = 0  # varlen with k and v in page pools (a block table): their page size, else 0

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k

    @property
    def longest(self) -> int:
        """The longer sequence: picks the short-sequence tile rows."""
        return max(self.seqlen_q, self.seqlen_k)

    @property
    def span(self) -> int:
        """The most keys a query row sees: a two-sided window's width, else the longer sequence."""
        left, right = self.window
        return self.longest if min(left, right) < 0 else min(self.longest, left + right + 1)

    @property
    def element_size(self) -> int:
        return _BYTES[self.dtype]

    @property
    def block_d(self) -> int:
        """The head dims as the Triton kernels compute them (the larger of d and dv, padded)."""
        return max(block_d(self.headdim), block_d(self.headdim_v))

    @property
    def causal(self) -> bool:
        return self.window == (-1, 0)

    @property
    def banded(self) -> bool:
        """A window (causal included): tiles differ in work."""
        return self.window != (-1, -1)

    @property
    def gluon_features(self) -> bool:
        """No option the Gluon kernels lack: 16-bit, no dropout. Windows (causal included), softcap, ALiBi,
        sinks and the forward's varlen layout are compile-time variants of their bodies."""
        return not self.dropout and self.dtype in ("float16", "bfloat16")

    @property
    def tma_ready(self) -> bool:
        """The streamed tensors suit TMA descriptors: sm90+, 16-bit, aligned."""
        return (self.cuda and self.capability[0] >= 9 and self.dtype in ("float16", "bfloat16")
                and self.aligned)

    @property
    def tma(self) -> bool:
        """The Triton kernels' streamed tiles can go through TMA descriptors: tma_ready in the padded layout
        (a varlen tile would read the next sequence's rows instead of zeros; the Gluon forward masks them)."""
        return self.tma_ready and not self.varlen


@dataclass(frozen=True)
class TritonForward:
    """kernels/triton/attn_fwd.py: one program per (query tile, head), every feature."""

    tiles: TileConfig
    tma: bool  # K/V tiles through TMA descriptors (else pointer loads)
    lpt_group: int  # heads per group of the heaviest-first launch order (1: head by head)
    kernel = "triton"


@dataclass(frozen=True)
class GluonForward:
    """kernels/gluon/attn_fwd.py: a loader warp and two or three consumer warpgroups of 64 query rows."""

    tiles: TileConfig  # block_m: 128 or 192 rows; block_n: 32, 64 or 128 keys; num_stages: K/V ring slots
    lpt_group: int
    head_dim: int  # Q's and K's tile width: d padded to 64, 128, 192 (three 64-wide chunks) or 256
    # Q buffers: 2 (the next query tile's Q loads during this one) or 1 where two do not fit beside the K/V
    # ring (the next Q then loads once this tile's O is stored, so no deferred release)
    q_buffers: int = 2
    persistent: bool = True  # one program per SM, each taking its next tile from a shared counter
    defer_release: bool = True  # a tile's O store completes under the next tile's first QK^T
    # a right edge: a warpgroup skips the upper half of its last key tile when it sees none of it
    half_diag: bool = False
    trees: int = 3  # bit 0: the row max as a register tree (else a chain); bit 1: the per-lane row sums
    maxnreg: int = MAXNREG_TWO
    # FA3's pack_gqa: > 1, a query tile holds a GQA group's heads side by side (the group padded to this
    # power of two), so K and V stream once per group and few query rows still fill a tile (`gqa_pack`)
    pack: int = 1
    # the next key tile's QK^T issued before this one's softmax, which then overlaps it as well as the
    # previous tile's PV (one step deeper than FA3's intra-warpgroup pipelining, which every two-consumer
    # build does): two S tiles in registers beside O, so two consumers only, no half step, no block-sparse
    # lists (fwd_steps.ahead_steps)
    qk_ahead: bool = False
    kernel = "gluon"


@dataclass(frozen=True)
class TritonBackward:
    """kernels/triton/attn_bwd.py: a dK/dV program per key tile and a dQ program per query tile; every
    gradient element written by one program (deterministic)."""

    dkdv_tiles: TileConfig
    dq_tiles: TileConfig
    tma: bool  # the dQ program's K/V through descriptors (the dK/dV program's Q/dO stay on pointers)
    kv_group: int  # launch-order groups of the dK/dV and the dQ programs
    q_group: int
    kernel = "triton"


@dataclass(frozen=True)
class GluonBackward:
    """kernels/gluon/attn_bwd.py: dK/dV per key tile with dQ added into a float32 buffer by TMA
    reduce-adds (their order varies unless deterministic)."""

    tiles: TileConfig  # block_m: query rows per step; block_n: keys per program; num_stages: (Q, dO) slots
    kv_group: int
    defer_dq: bool = False  # 64-row steps at d = 64: each step computes the previous step's dQ
    maxnreg: int = MAXNREG_TWO
    # programs per key tile and kv head, each over group / group_split query heads, adding dK and dV into
    # float32 buffers (a divisor of the GQA group; 1: one program walks the whole group, no atomics)
    group_split: int = 1
    # the dQ adds into each query tile in a fixed order (a dQ-writer warp and counters): bitwise-reproducible
    # gradients; with a group split, each part adds dK and dV into kv heads of its own, summed after in a
    # fixed order (the buffers group_split times larger)
    deterministic: bool = False
    # deterministic, attn_bwd.py's kernel: the query rows over which its dQ writer keeps the order (a
    # multiple of tiles.block_m: one count wait and one count-in for that many rows; 0: block_m)
    dq_order_rows: int = 0
    # attn_bwd_dsplit.py's kernel (wide heads): its Q/K column units (192 or 256) and dO stages (num_stages
    # counts the Q stages there); 0: attn_bwd.py's
    d_qk: int = 0
    do_stages: int = 0
    # attn_bwd_keys.py's kernel (d_qk 192 beside dv up to 128): 128 keys a program, each warpgroup 64 of them
    # and all their columns, 32-row steps (tiles 32 x 128), dQ transposed
    wide_keys: bool = False
    kernel = "gluon"


def lpt_group(spec: Spec, n_heads: int, stream_bytes: int) -> int:
    """Heads per group of the launch order (kernels/triton/common.py, grouped_program), each streaming
    stream_bytes: 1 (head by head) when every tile does the same work, else as many as fit the L2 budget."""
    if not spec.banded:
        return 1
    return max(1, min(n_heads, L2_BUDGET // max(stream_bytes, 1)))


def _triton_tma(spec: Spec, tiles: TileConfig) -> bool:
    # d = 128 only: descriptors gave the d = 128 backward +1-3% over pointer loads but cost d = 64 7-10%; and
    # the ptxas of Triton 3.6 crashes (SIGSEGV) on descriptor loads pipelined over 2 stages
    return spec.tma and spec.headdim == 128 and spec.headdim_v == 128 and tiles.num_stages >= 3


def gluon_head_dim(spec: Spec) -> int:
    """Q's and K's tile width in the Gluon forward: d padded to a power of two, or to 192 for 16-bit d in
    129..192 (FA3's widths: padding it to 256 cost QK^T a third more work and the tiles shared memory for
    half the keys a step), unless dv pads to 256 (O is staged in Q's buffer). FP8 keeps the power of two (its
    192-wide chunks are untried)."""
    width = block_d(spec.headdim, spec.element_size)
    if width == 256 and spec.headdim <= 192 and spec.element_size == 2 and block_d(spec.headdim_v) <= 128:
        return 192
    return width


def _forward_smem(spec: Spec, tiles: TileConfig, head_dim: int, q_buffers: int) -> int:
    """Bytes of the Gluon forward's tiles in shared memory: Q buffers of block_m rows, the K/V ring, and an
    FP8 call's 16-bit O staging."""
    e, dv = spec.element_size, block_d(spec.headdim_v)
    ring = tiles.num_stages * tiles.block_n * (head_dim + dv) * e
    o_staging = tiles.block_m * dv * 2 if e == 1 else 0
    return q_buffers * tiles.block_m * head_dim * e + ring + o_staging


def gluon_q_buffers(spec: Spec, tiles: TileConfig, head_dim: int) -> int:
    """2 Q buffers where they fit the shared memory beside the K/V ring (and an FP8 call's 16-bit O
    staging), else 1."""
    return 2 if _forward_smem(spec, tiles, head_dim, 2) <= SMEM_BYTES else 1


def gluon_forward_tiles(spec: Spec) -> TileConfig:
    """The Gluon forward's tiles, held to what the kernel does: 32, 64 or 128 keys a step (its half-diagonal
    step only with 128), two or three consumer warpgroups of 64 rows (two from d = 192: two Q tiles of three
    would fill the shared memory), a K/V ring of 2+ slots, and one Q buffer at least beside it."""
    # under a band a query tile's work is that of a causal tile at a length of about the band's width (not
    # measured apart from causal masking): the causal rows at that length
    width = gluon_head_dim(spec)
    tiles = tile_config("fwd_ws", width, spec.cuda, spec.span, spec.banded, fp8=spec.element_size == 1)
    rows = (2 * HALF_M,) if width > 128 else (2 * HALF_M, 3 * HALF_M)
    smem = _forward_smem(spec, tiles, width, 1)
    if smem > SMEM_BYTES:
        raise FlashAttnError(
            f"tile override fwd_ws={tiles.block_m},{tiles.block_n},{tiles.num_warps},{tiles.num_stages} "
            f"needs {smem // 1024} KiB of shared memory at d = {width} (at most {SMEM_BYTES // 1024})")
    if tiles.block_n not in (32, 64, 128) or tiles.block_m not in rows or tiles.num_stages < 2:
        raise FlashAttnError(
            f"tile override fwd_ws={tiles.block_m},{tiles.block_n},{tiles.num_warps},{tiles.num_stages} is "
            f"not a config of the Gluon forward at d = {width}, which takes block_m "
            f"{' or '.join(map(str, rows))} (consumer warpgroups of 64 rows), block_n 32, 64 or 128 and 2 or "
            f"more stages"
        )
    return tiles


def _gluon_shapes(spec: Spec) -> bool:
    # Q and K padded to a tile width, V and O to theirs (TMA reads the columns past d and dv as zeros and
    # clips the stores there; a varlen tile's last rows go by masked stores that stop at dv); O is staged in
    # Q's buffer, hence no wider (and a descriptor needs rows: a varlen batch of only empty sequences,
    # max_seqlen 0, may have none)
    width, dv_width = gluon_head_dim(spec), block_d(spec.headdim_v)
    return (width in GLUON_HEADDIMS and dv_width in GLUON_HEADDIMS_V and dv_width <= width
            and min(spec.seqlen_q, spec.seqlen_k) > 0)


def takes_gluon_forward(spec: Spec) -> bool:
    """A 16-bit call on sm90+ with TMA-ready tensors at head dims the Gluon tiles hold: on the H100 the
    Gluon forward ran d 80 and 96 (padded to 128) at 1.2-1.4x the Triton one's TFLOP/s and its backward at
    1.3x (benchmarks/results/2026-12-06-padded-heads-h100)."""
    return spec.gluon_features and spec.tma_ready and _gluon_shapes(spec)


def dq_buffer_bytes(spec: Spec) -> int:
    """The Gluon backward's float32 dQ buffer: one float per element of q."""
    rows = spec.tokens_q if spec.varlen else spec.batch * spec.seqlen_q
    return rows * spec.nheads * spec.headdim * 4


def _wide_backward(spec: Spec) -> bool:
    """A call that attn_bwd_dsplit.py's kernel can run: Q/K 129..256 columns wide beside V's 128 or 256 (dv
    padded to a power of two, as its tiles are)."""
    return (gluon_head_dim(spec), block_d(spec.headdim_v)) in GLUON_BWD_WIDE


def _keys_backward(spec: Spec) -> bool:
    """A call for attn_bwd_keys.py's kernel: Q/K 192 wide (d 129..192) beside dv 33..128 (its tiles 64 or 128
    wide; the range its GPU tests and compile checks run)."""
    return gluon_head_dim(spec) == 192 and 64 <= block_d(spec.headdim_v) <= 128


def backward_head_groups(dq_bytes: int, nheads: int, nheads_k: int, dropout: bool) -> int:
    """How many groups of query heads the backward of a call with a float32 dQ buffer of dq_bytes (4 per
    element of q) runs in (backends/triton/head_groups.py): 1 at or under DQ_BUFFER_CAP or with dropout (its
    random stream is indexed by head). Else groups of whole KV heads (each with its query heads: gradients
    the whole call's bit for bit) where some count brings a group under the cap, the fewest with at most
    DQ_GROUP_BYTES of buffer each or else one KV head a group; else each KV head's query heads in parts
    (MQA, or a few KV heads of wide groups: the parts' dK and dV summed in float32), chosen alike; 1 where
    nothing brings a group under the cap."""
    if dq_bytes <= DQ_BUFFER_CAP or dropout:
        return 1
    group = nheads // nheads_k
    whole = [n for n in range(2, nheads_k + 1) if nheads_k % n == 0]
    parts = [nheads_k * p for p in range(2, group + 1) if group % p == 0]
    for counts in (whole, parts):
        fits = [n for n in counts if dq_bytes // n <= DQ_BUFFER_CAP]
        if fits:
            return next((n for n in fits if dq_bytes // n <= DQ_GROUP_BYTES), fits[-1])
    return 1


def takes_gluon_backward(spec: Spec) -> bool:
    # d padded to 64 or 128 beside dv <= d (attn_bwd.py: every tile as wide as d's; its deterministic
    # variant only at d = dv = 64 or 128, the head dims its GPU tests run), or the wide pairs
    # (attn_bwd_keys.py at width 192, attn_bwd_dsplit.py at 256, deterministic too); other head dims keep
    # the Triton backward, and so does a
    # deterministic call with a learnable sink, whose gradient the Gluon programs add in no fixed order
    exact = spec.headdim in GLUON_BWD_HEADDIMS and spec.headdim_v == spec.headdim
    padded = block_d(spec.headdim) in GLUON_BWD_HEADDIMS and spec.headdim_v <= spec.headdim
    shapes = (padded and (exact or not spec.deterministic)) or _keys_backward(spec) or _wide_backward(spec)
    return (takes_gluon_forward(spec) and shapes and not (spec.deterministic and spec.sink)
            and dq_buffer_bytes(spec) <= DQ_BUFFER_CAP)


def _dsplit_smem(spec: Spec, tiles: TileConfig, do_stages: int) -> int:
    """Bytes of attn_bwd_dsplit.py's tiles in shared memory: Q (256 wide) and its stats rows over num_stages,
    dO over do_stages, K, V (dO's and V's at dv's padded width, as the tiles are), two steps' P and dS
    tiles, and two 64-column float32 dQ staging tiles."""
    m, n, e, dv = tiles.block_m, tiles.block_n, spec.element_size, block_d(spec.headdim_v)
    q = tiles.num_stages * m * (256 * e + 2 * 4)
    return q + do_stages * m * dv * e + n * (256 + dv) * e + 4 * m * n * e + 2 * m * 64 * 4


def _stream_group(spec: Spec, pack: int = 1) -> int:
    """The forwards' launch-order group: work items per query head, each streaming its share of the kv
    head's keys; packed (pack > 1), per kv head, each streaming them whole."""
    heads = spec.nheads_k if pack > 1 else spec.nheads
    stream = spec.seqlen_k * (spec.headdim + spec.headdim_v) * spec.element_size * spec.nheads_k // heads
    return lpt_group(spec, spec.batch * heads, stream)


def takes_gqa_pack(spec: Spec) -> bool:
    """A call whose GQA group the Gluon forward can pack into its query tiles: a group of up to 256 heads (64
    under varlen, where a tile's rows are whole positions, block_m // pack of them), 16-bit."""
    return 1 < spec.group <= (HALF_M if spec.varlen else 256) and spec.element_size == 2


def gqa_pack(spec: Spec, block_m: int) -> int:
    """The Gluon forward's pack (GluonForward.pack) for a spec it takes: the GQA group padded to a power of
    two where packing fills the query tiles better, FA3's rule: the share of a tile's rows that hold a
    query row, unpacked below 0.9 of the packed one's (64 query rows of 32 heads over 8 KV heads: half of
    each 128-row tile unpacked, all of it packed, and K/V read once per group instead of four times); else 1.
    Varlen: at the sequences' mean length.
    """
    if not takes_gqa_pack(spec):
        return 1
    pack = 1 << (spec.group - 1).bit_length()
    rows = max(1, spec.tokens_q // max(spec.batch, 1)) if spec.varlen else spec.seqlen_q
    plain = rows / (-(-rows // block_m) * block_m)
    packed = rows * spec.group / (-(-rows * pack // block_m) * block_m)
    return pack if plain < 0.9 * packed else 1


def gluon_forward_route(spec: Spec, packed: bool = True) -> GluonForward:
    """The Gluon forward's route for a spec it takes (takes_gluon_forward). packed: with the GQA group packed
    into the query tiles where `gqa_pack` takes it (False: a tile per query head, the bench's A/B
    `flashattn-unpacked`). On the H100 (benchmarks/results/2026-12-06-short-packed-h100, b8, 64 query rows
    of 32 heads over 8 or 1 KV heads, d128 causal) packed ran 1.06-1.15x the unpacked forward at 4K keys and
    1.8-2.1x at 32K."""
    tiles = gluon_forward_tiles(spec)
    pack = gqa_pack(spec, tiles.block_m) if packed else 1
    three = tiles.block_m == 3 * HALF_M
    # tree reductions: +5% with two consumers at d=64 1K causal, -2 to -4% with three. The half-diagonal
    # step wherever the band has a right edge: a warpgroup's last key tile then often has its upper half
    # masked for all its rows, as under causal masking (on 128-key tiles: the step splits one in halves)
    # (not for FP8: its V tiles are K-major, and the half step's half of one would be a slice through the
    # middle of each 128-byte swizzle row, which a wgmma operand cannot start at)
    # (nor packed: the half step's rows are one position each)
    half_diag = spec.window[1] >= 0 and tiles.block_n == 128 and spec.element_size == 2 and pack == 1
    width = gluon_head_dim(spec)
    q_buffers = gluon_q_buffers(spec, tiles, width)
    return GluonForward(tiles, _stream_group(spec, pack), width, q_buffers, defer_release=q_buffers == 2,
                        half_diag=half_diag, trees=0 if three else 3,
                        maxnreg=tiles.maxnreg or (MAXNREG_THREE if three else MAXNREG_TWO), pack=pack)


def triton_forward_route(spec: Spec) -> TritonForward:
    """The Triton forward's route, which serves every spec."""
    tiles = tile_config("fwd", spec.block_d, spec.cuda, spec.longest)
    if spec.cuda and spec.softcap and spec.headdim < spec.block_d == 256 and tiles.num_stages > 1:
        # Triton 3.6's code for this kernel with a softcap over a padded 256-wide head (d 129..255: column
        # masks) pipelined over 2+ stages stops on a misaligned address on the H200 on most calls (timing-
        # dependent: clean under compute-sanitizer); one stage runs clean, and d 256 or no softcap never
        # faulted (tests/backends/triton/test_attention_gpu.py repeats the spec)
        tiles = replace(tiles, num_stages=1)
    return TritonForward(tiles, _triton_tma(spec, tiles), _stream_group(spec))


def takes_gluon_fp8_forward(spec: Spec) -> bool:
    """An FP8 call that the Gluon forward's FP8 variant serves faster than the Triton one: the padded layout
    (its varlen launch is refused, attention.py), a 16-bit output, the Gluon head dims, and the lengths where
    the fp8 suite measured it ahead on the H200 (benchmarks/results/2026-12-01-fp8): from 2K tokens, and
    under a mask from 2K at d >= 128 and from 8K at d = 64, it ran +3% to +25% (one point -0.6%: d 256 8K
    full); at 1K it lost up to 31% under causal masking, and d 64 lost up to 2.6% under it below 8K."""
    if not (spec.dtype == "float8_e4m3fn" and spec.cuda and spec.capability[0] >= 9 and spec.aligned
            and not spec.varlen and spec.out_dtype in ("float16", "bfloat16") and _gluon_shapes(spec)
            and spec.headdim_v in GLUON_HEADDIMS_V):  # its K-major V at a padded dv is untried
        return False
    shortest = 8192 if spec.banded and block_d(spec.headdim) <= 64 else 2048
    return spec.longest >= shortest


def reads_pages(spec: Spec, route) -> bool:
    """Whether `route` runs a paged call (spec.page_size > 0) on its page pools, mapping each key tile
    through the block table (kernels/gluon/fwd_loader.py): the 16-bit Gluon forward, where each of its key
    tiles lies in one page (page_size a multiple of block_n). Otherwise the launcher first gathers the keys
    into the packed layout (flashattn.paged.gather_pages), which costs a read and a write of them."""
    return (spec.page_size > 0 and isinstance(route, GluonForward) and not spec.out_dtype
            and spec.page_size % route.tiles.block_n == 0)


def forward_route(spec: Spec) -> TritonForward | GluonForward | SplitForward:
    """The forward's default route: on Hopper (16-bit), the split-KV decode kernel for forwards of few query
    rows against their keys (decode_routes.split_forward_wins), else the Gluon forward (its GQA group packed
    where `gqa_pack` takes it)."""
    if takes_gluon_forward(spec):
        return SplitForward() if split_forward_wins(spec) else gluon_forward_route(spec)
    if takes_gluon_fp8_forward(spec):
        return gluon_forward_route(spec)
    return triton_forward_route(spec)


def _kv_group(spec: Spec) -> int:
    row_bytes = (spec.headdim + spec.headdim_v) * spec.element_size
    return lpt_group(spec, spec.batch * spec.nheads_k, spec.seqlen_q * row_bytes * spec.group)


def group_split(spec: Spec) -> int:
    """Programs per key tile and kv head of the Gluon backward: the largest divisor of the GQA group up to
    min(8, group / 2), so that each program walks two or more of the group's query heads. On the H200
    (benchmarks/results/2026-12-02-workloads-fa4, b2 N8K d128 causal) MQA 32/1 ran its backward at 295
    TFLOP/s with one program per key tile, 366 split in 2 and 479 in 8; GQA 32/8 at 482, 500 split in 2
    and 494 in 4. Deterministic calls split the same (on the H100, 2026-12-06-deterministic-variants-h100:
    MQA 32/1 7.89 ms against 12.6 unsplit, GQA 32/8 6.79 against 7.62), each part adding into kv heads of
    its own, so their buffers count once per part. Not where the float32 dK and dV buffers would pass
    SPLIT_BUFFER_CAP (varlen: counted over batch · max_seqlen_k keys, a bound on the packed ones)."""
    most = min(8, spec.group // 2)
    buffers = spec.batch * spec.seqlen_k * spec.nheads_k * (spec.headdim + spec.headdim_v) * 4
    fits = [n for n in range(2, most + 1)
            if spec.group % n == 0 and buffers * (n if spec.deterministic else 1) <= SPLIT_BUFFER_CAP]
    return max(fits, default=1)


def gluon_backward_route(spec: Spec, masked: bool = False) -> GluonBackward:
    """The Gluon backward's route for a spec it takes (takes_gluon_backward). masked: the call has a mask
    beyond spec's band (a block-sparse one's partial blocks), which takes the masked calls' tiles."""
    if _keys_backward(spec):
        return wide_keys_backward_route(spec)
    if _wide_backward(spec):
        return dsplit_backward_route(spec)
    # the causal rows (at d = 64, 64-row steps) under any mask, and where a softcap or ALiBi holds more per
    # step: 128-row steps spilled 0.4-1.1 KB with either. The tiles are those of the head dims' padded width
    # (the kernel's tiles are that wide: TMA reads zeros past d)
    width = block_d(spec.headdim, spec.element_size)
    tiles = tile_config("bwd_ws", width, spec.cuda,
                        causal=masked or spec.banded or spec.softcap or spec.alibi)
    # 64-row steps at d = 64 compute each step's dQ one step late: the four dS^T buffers this needs leave no
    # shared memory for 128-row steps
    # deterministic: the dQ writer keeps its order per 128 rows over 64-row steps (one count wait and one
    # count-in per two steps): on the H100 (2026-12-06-deterministic-variants-h100) d64 causal 4K ran at
    # 354 TFLOP/s against 270 per step, 16K 415 against 308, d128 causal 409 / 475 against 374 / 442
    order_rows = 128 if spec.deterministic and tiles.block_m == 64 else 0
    return GluonBackward(tiles, _kv_group(spec), defer_dq=width == 64 and tiles.block_m == 64,
                         maxnreg=tiles.maxnreg or MAXNREG_TWO, group_split=group_split(spec),
                         deterministic=spec.deterministic, dq_order_rows=order_rows)


def _wide_call(spec: Spec, shapes: bool, deterministic: bool = False) -> bool:
    """A call for a wide-head Gluon backward at head dims it takes (shapes): the Gluon backward's calls
    (takes_gluon_forward: 16-bit, sm90+, TMA-ready, no dropout; the dQ buffer cap), deterministic ones
    where the kernel has that variant (not with a learnable sink)."""
    return (takes_gluon_forward(spec) and shapes and not (spec.deterministic and not deterministic)
            and not (spec.deterministic and spec.sink) and dq_buffer_bytes(spec) <= DQ_BUFFER_CAP)


def dsplit_backward_route(spec: Spec) -> GluonBackward:
    """attn_bwd_dsplit.py's route (a program per 64 keys, the gradients split by columns) for a spec at Q/K
    width 192 or 256 beside dv padded to 128 or 256 (GLUON_BWD_WIDE): the default at width 256, an explicit
    route at 192. Deterministic (no sink): its dQ writer's variant, each step's dQ units staged in two
    rounds."""
    if not _wide_call(spec, _wide_backward(spec), deterministic=True):
        raise FlashAttnError(f"the wide-head Gluon backward takes 16-bit, TMA-ready calls at d 129..256 "
                             f"beside dv padded to 128 or 256 (192-wide Q/K beside 128 only), no dropout, "
                             f"and no learnable sink with a deterministic order, not d {spec.headdim}, "
                             f"dv {spec.headdim_v}, {spec.dtype}, dropout={spec.dropout}, "
                             f"deterministic={spec.deterministic}, sink={spec.sink}")
    tiles = tile_config("bwd_ws", 256, spec.cuda)
    # two dO stages where they fit beside two Q stages (dv = 128), else one (dv = 256, as FA3)
    do_stages = 2 if _dsplit_smem(spec, tiles, 2) <= SMEM_BYTES else 1
    if tiles.block_m != 64 or tiles.block_n != 64 or _dsplit_smem(spec, tiles, do_stages) > SMEM_BYTES:
        raise FlashAttnError(
            f"tile override bwd_ws={tiles.block_m},{tiles.block_n},{tiles.num_warps},{tiles.num_stages} "
            f"is not a config of the wide-head Gluon backward, which takes 64 query rows, 64 keys and "
            f"the Q stages that fit {SMEM_BYTES // 1024} KiB of shared memory")
    return GluonBackward(tiles, _kv_group(spec), maxnreg=tiles.maxnreg or MAXNREG_TWO,
                         group_split=group_split(spec), d_qk=gluon_head_dim(spec), do_stages=do_stages,
                         deterministic=spec.deterministic)


def wide_keys_backward_route(spec: Spec) -> GluonBackward:
    """attn_bwd_keys.py's route for a spec at d_qk 129..192 beside dv up to 128: 32-row steps over two (Q, dO)
    stages, 128 keys a program. Deterministic (no sink): its dQ writer's variant, each step's three dQ
    units staged in tiles of their own."""
    if not _wide_call(spec, _keys_backward(spec), deterministic=True):
        raise FlashAttnError(f"the 128-key wide-head backward takes 16-bit, TMA-ready calls at d 129..192 "
                             f"beside dv 33..128, no dropout, and no learnable sink with a deterministic "
                             f"order, not d {spec.headdim}, dv {spec.headdim_v}, {spec.dtype}, "
                             f"dropout={spec.dropout}, deterministic={spec.deterministic}, sink={spec.sink}")
    return GluonBackward(TileConfig(32, 128, 4, 2), _kv_group(spec), maxnreg=MAXNREG_TWO,
                         group_split=group_split(spec), d_qk=192, wide_keys=True,
                         deterministic=spec.deterministic)


def triton_backward_route(spec: Spec) -> TritonBackward:
    """The Triton backward's route, which serves every spec."""
    dkdv = tile_config("dkdv", spec.block_d, spec.cuda, spec.longest)
    dq = tile_config("dq", spec.block_d, spec.cuda, spec.longest)
    row_bytes = (spec.headdim + spec.headdim_v) * spec.element_size
    q_group = lpt_group(spec, spec.batch * spec.nheads, spec.seqlen_k * row_bytes // spec.group)
    return TritonBackward(dkdv, dq, _triton_tma(spec, dq), _kv_group(spec), q_group)


def backward_route(spec: Spec) -> TritonBackward | GluonBackward:
    """The backward's default route (spec.aligned covers dout as well)."""
    return gluon_backward_route(spec) if takes_gluon_backward(spec) else triton_backward_route(spec)
