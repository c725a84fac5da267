"""Launchers of the warp-specialised Hopper kernels: the forward (kernels/gluon/attn_fwd.py) and the backward
(kernels/gluon/attn_bwd.py, and attn_bwd_dsplit.py for wide heads), given their route (routes.GluonForward /
routes.GluonBackward).

The routes send them fp16/bf16 calls with TMA-ready tensors on sm90+: the forward at d and dv padded to its
widths (d to 64, 128, 192 or 256; dv to 64, 128 or 256, no wider than d's); the backward at d padded to 64
or 128 beside dv <= d, and at d 129..256 beside dv padded to 128 or 256 (routes.takes_gluon_forward,
takes_gluon_backward); both in either layout. Windows, softcap, ALiBi, sinks
and the varlen layout are compile-time variants of the kernels, each passed as None when off (`band_args`,
`softcap_args`, `alibi_args`). Both read and write every streamed tile through TMA descriptors, built here
per call over the call's tensors with the shapes, strides and shared layouts the route fixes.

Forward grid: persistent (one program per SM, as one fills an SM's registers); after the first, each program
takes its next query tile from a shared counter, so under a causal mask the programs' totals even out (a
static walk with the grid's stride left the busiest 15% over the mean); the kernel's last program zeroes the
counter again, so one per stream serves every call (`_tile_counter`).

FP8 (e4m3 q, k, v with descales; the default route takes it where it measured faster,
routes.takes_gluon_fp8_forward): V goes to its descriptor K-major, as a (batch, heads_k, dv, seqlen) view of a
seqlen-contiguous V (`kmajor_v`, which copies a V of another layout, or one whose seqlen is not a multiple
of 16, into that layout), O is 16-bit.

The backward (FlashAttention-3's: dQ by TMA reduce-adds into a float32 buffer, 5 matmuls per tile pair
instead of the Triton backward's 7) reads each step's LSE (base 2) and D = rowsum(dO ∘ O) from padded
planes that the preprocess fills (`backward_buffers`).
"""

import functools

import torch

from flashattn import _internals
from flashattn.backends.triton import host
from flashattn.backends.triton.launch import Bound
from flashattn.backends.triton.merge import sm_count
from flashattn.backends.triton.routes import HALF_M, GluonBackward, GluonForward
from flashattn.errors import FlashAttnError


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple, dtype_name: str):
    """The wgmma-ready shared layout of a TMA block of this shape. Cached: building it costs ~15 us of host
    time, and every launch asks for 4-7 of them."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype_name))


@functools.cache
def _make_descriptor():
    return _internals.descriptor_factory()


def _descriptor_spec(t, rows: int, cols: int, dtype_name: str | None = None) -> tuple:
    """What a TMA descriptor over a (batch, seqlen, heads, d) tensor like t with (1, rows, 1, cols) blocks in
    the wgmma-ready shared layout takes besides t; dtype_name: the Gluon element type (default: t's 16-bit
    type). The same for every tensor of t's shape, strides and dtype: a prepared launch keeps it."""
    if dtype_name is None:
        dtype_name = _GLUON_DTYPES[t.dtype]
    block = (1, rows, 1, cols)
    return list(t.shape), list(t.stride()), list(block), _shared_layout(block, dtype_name)


def _packed_spec(t, group: int, pack: int, cols: int) -> tuple:
    """_descriptor_spec of a (batch, seqlen, heads, d) tensor t as the (batch, seqlen, heads_k, group, d)
    view of FA3's pack_gqa (routes.gqa_pack): blocks of HALF_M rows, HALF_M // pack positions x `pack` heads
    of a group (`pack`: the group padded to a power of two; the rows past the group read as zeros and are
    clipped from the stores), or HALF_M of one position's heads where pack is larger."""
    b, n, h, d = t.shape
    heads = min(pack, HALF_M)
    rows = HALF_M // heads
    block = (1, rows, 1, heads, cols)
    return ([b, n, h // group, group, d], [t.stride(0), t.stride(1), group * t.stride(2), t.stride(2), 1],
            list(block), _shared_layout(block, _GLUON_DTYPES[t.dtype]))


_GLUON_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8e4nv"}


def kmajor_v(v, varlen: bool):
    """An FP8 V as the (batch, heads_k, dv, seqlen) view the K-major descriptor takes (varlen: batch 1 over
    the packed tokens), seqlen contiguous with 16-byte aligned row strides: v itself where it is laid out
    so, else a copy (the seqlen padded to a multiple of 16; the descriptor's shape keeps the true one)."""
    vt = v.permute(1, 2, 0).unsqueeze(0) if varlen else v.permute(0, 2, 3, 1)
    if vt.stride(-1) == 1 and all(st % 16 == 0 for st in vt.stride()[:-1]):
        return vt
    n = vt.shape[-1]
    padded = torch.empty((*vt.shape[:-1], -(-n // 16) * 16), dtype=v.dtype, device=v.device)
    padded[..., :n].copy_(vt)
    return padded[..., :n]


def _kmajor_spec(vt, block_n: int) -> tuple:
    block = (1, 1, vt.shape[2], block_n)
    return list(vt.shape), list(vt.stride()), list(block), _shared_layout(block, "float8e4nv")


class Prepared:
    """A launch of a Gluon kernel with all but its per-call tensors derived: what `forward` and `backward`
    return, and take back (the launchers keep it per call signature) to skip the derivations for tensors of
    the same shapes, strides, dtypes and alignment. Its first launch goes through `launch` (a Bound: the JIT,
    then a plan); after that, where this Triton allows it (flashattn._internals.direct_launch), straight to
    the compiled kernel's launcher with the descriptors filled from their base tensors."""

    __slots__ = ("launch", "specs", "args", "schedule", "direct", "direct_plan")

    def __init__(self, launch: Bound, specs: tuple, args: tuple, schedule: Bound | None = None):
        self.launch = launch
        self.specs = specs  # _descriptor_spec of each descriptor parameter, in order (they come first)
        self.args = args  # the arguments between the per-call tensors that follow the descriptors
        self.schedule = schedule  # a varlen call's launch of the tile-offsets kernel (`_schedule`)
        self.direct = None  # the direct launch of direct_plan's compiled kernel, where this Triton allows one
        self.direct_plan = None

    def descriptors(self, *tensors) -> list:
        make = _make_descriptor()
        return [make(t, *spec) for t, spec in zip(tensors, self.specs, strict=True)]

    def __call__(self, bases: tuple, rest: tuple) -> None:
        """Launch with descriptors over `bases` and the runtime arguments `rest` that follow them."""
        plan = self.direct_plan
        if self.direct is not None and _internals.current_device() == plan.device:
            for i, aligned in plan.pointers:  # the tensors among rest: their alignment is specialised on
                if (rest[i - len(bases)].data_ptr() % 16 == 0) is not aligned:
                    break
            else:
                self.direct(self.launch.grid3, _internals.raw_stream(plan.device), bases, (*rest, *plan.tail))
                return
        self.launch((*self.descriptors(*bases), *rest))
        plan = self.launch.plan
        if plan is not None and plan is not self.direct_plan:
            self.direct_plan = plan
            self.direct = _internals.direct_launch(plan.compiled, tuple(spec[:2] for spec in self.specs))


_counters: dict = {}


def _tile_counter(device: torch.device) -> torch.Tensor:
    """The forward's tile counter and arrival count (int32 x 2), zero between launches: the kernel's last
    program resets them, so each stream keeps one (launches on a stream run one after another) and a call
    launches no zeroing kernel. Under CUDA graph capture every call gets a fresh zeroed pair of its own (the
    zeroing is captured): graphs may replay on several streams at once."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # CPU: the sm90 compile check
        return torch.zeros(2, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else _internals.current_device()
    key = (index, _internals.raw_stream(index))
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def forward(pb, route: GluonForward, q, k, v, out, lse, prepared: Prepared | None = None, alibi_slopes=None,
            learnable_sink=None, cu_seqlens_q=None, cu_seqlens_k=None, descales=None,
            block_table=None, block_mask=None) -> Prepared:
    """Fill out and lse (attention_forward's contract) with the warp-specialised kernel. prepared: what this
    returned for an earlier call of the same signature and route, skipping the derivations; returns the
    launch prepared. Varlen (pb.varlen, cu_seqlens given): the packed tensors go to the descriptors as one
    batch, and the kernel gets the query tiles before each sequence (`varlen_tile_offsets`). descales: an
    FP8 call's (q_descale, k_descale, v_descale), float32 (1,) or (batch, heads). block_table: (batch,
    max_pages) int32 with k and v page pools (num_pages, page_size, heads_k, ·), varlen only, on a route
    that reads them (routes.reads_pages): the descriptors cover the pools, and the kernel maps each key
    tile through the table. block_mask: a block-sparse call's BlockMaskKernelTensors (padded layout, no
    band; its query blocks the route's query tiles, its key blocks a multiple of the route's key tiles), whose
    lists the kernel walks instead of every key tile (kernels/gluon/sparse.py)."""
    streamed = (q, k, v, out)
    if descales is not None:
        streamed = (q, k, kmajor_v(v, pb.varlen), out)
    if prepared is None:
        prepared = _prepare_forward(pb, route, *_as_batch(pb, streamed), lse, fp8=descales is not None)
    varlen = (None,) * 7
    if pb.varlen:
        # packed GQA tiles (route.pack, which divides block_m under varlen): block_m // pack positions each
        offsets = varlen_tile_offsets(cu_seqlens_q, pb.batch, route.tiles.block_m // route.pack, q.shape[0],
                                      prepared.schedule)
        varlen = (cu_seqlens_q, cu_seqlens_k, offsets, out, out.stride(0), out.stride(1), pb.dv)
    pages = (None,) * 5
    if block_table is not None:
        page_size = k.shape[1]
        pages = (block_table, block_table.stride(0), k.shape[0], page_size, block_table.shape[1] * page_size)
    # the tiles past the first of each program go to whichever program asks first: a zeroed counter
    rest = (lse, *prepared.args, _tile_counter(q.device), *alibi_args(alibi_slopes), learnable_sink, *varlen,
            *pages, *fp8_args(pb, descales), *sparse_args(block_mask, route.tiles.block_n))
    prepared(streamed, rest)
    return prepared


def _as_batch(pb, tensors: tuple) -> tuple:
    """The streamed tensors as the descriptors see them: a varlen call's packed ones (tokens, heads, d) as
    one batch (1, tokens, heads, d). Only a launch's preparation needs the views: a launch reads nothing of
    a descriptor's base but its address, its shape and strides being the prepared ones."""
    if not pb.varlen:
        return tensors
    return tuple(t if t.dim() == 4 else t.unsqueeze(0) for t in tensors)


def _schedule(lists: int) -> Bound:
    """A launch of the tile-offsets kernel writing `lists` lists (the forward's one, the backward's two). A
    varlen call's Prepared keeps one: the call's signature fixes every argument of it but the tensors (the
    packed tokens, the batch and the tiles); a fresh one's first call goes through `launch`."""
    from flashattn.kernels.triton.tiles import varlen_tile_offsets_kernel

    return Bound(varlen_tile_offsets_kernel, (lists,), dict(BLOCK_B=1024))


def _tile_offsets(schedule: Bound | None, lists: int, args: tuple) -> None:
    (schedule if schedule is not None else _schedule(lists))(args)


def varlen_tile_offsets(cu_seqlens, batch: int, block_m: int, total: int,
                        schedule: Bound | None = None) -> torch.Tensor:
    """(batch + 1,) int32: the tiles of block_m rows before each sequence of a packed tensor of `total` rows
    (the last entry: all of them; the sequences clamped into those rows), which the varlen forward walks as
    one list of query tiles (kernels/triton/tiles.py). schedule: the forward's kept launch (Prepared), or
    None."""
    offsets = torch.empty(batch + 1, dtype=torch.int32, device=cu_seqlens.device)
    # one list: the second one's arguments repeat the first's (a grid of one never reads them)
    _tile_offsets(schedule, 1, (cu_seqlens, offsets, total, block_m) * 2 + (batch,))
    return offsets


def varlen_backward_offsets(pb, route: GluonBackward, cu_seqlens_q, cu_seqlens_k, q, k,
                            schedule: Bound | None = None) -> tuple:
    """(stats_row0, key_tiles), (batch + 1,) int32 each, in one launch: the varlen backward's 4-row steps
    before each sequence's rows in the stats planes (`backward_buffers`) and its key tiles before each
    sequence (varlen_tile_offsets' lists, of the packed q's and k's rows). schedule: the backward's kept
    launch (Prepared), or None."""
    rows, tiles = (torch.empty(pb.batch + 1, dtype=torch.int32, device=q.device) for _ in range(2))
    _tile_offsets(schedule, 2, (cu_seqlens_q, rows, q.shape[0], 4, cu_seqlens_k, tiles, k.shape[0],
                                route.tiles.block_n, pb.batch))
    return rows, tiles


def fp8_args(pb, descales) -> tuple:
    """The forward's (Q_SCALE, K_SCALE, V_SCALE, their (batch, head) strides, q_scale_group): strides 0 for a
    (1,) descale, q_scale_group the query heads sharing one of q's (batch, heads_k) descales; all None for a
    16-bit call, which compiles the variant out."""
    if descales is None:
        return (None,) * 10
    strides = []
    for t in descales:
        strides += (0, 0) if t.numel() == 1 else (t.stride(0), t.stride(1))
    q_group = pb.nheads // pb.nheads_k if descales[0].numel() > 1 and descales[0].shape[1] != pb.nheads else 1
    return (*descales, *strides, q_group)


def sparse_args(kt, block_n: int) -> tuple:
    """The forward's block-sparse arguments (kernels/gluon/sparse.py): the mask's count, list, bit and order
    tensors, its batch and head dims, query blocks, list widths, key block, the kernel's key tiles in one and
    a bitmask row's bytes; all None without a mask, which compiles the variant out."""
    if kt is None:
        return (None,) * 14
    return (kt.kv_full_num, kt.kv_full_idx, kt.kv_part_num, kt.kv_part_idx, kt.part_bits, kt.q_order,
            kt.kv_full_num.shape[0], kt.kv_full_num.shape[1], kt.n_qblocks, kt.kv_full_idx.shape[3],
            kt.kv_part_idx.shape[3], kt.block_n, kt.block_n // block_n, kt.block_n // 8)


def sparse_backward_args(kt) -> tuple:
    """The backward's block-sparse arguments (kernels/gluon/sparse_bwd.py): the mask's column lists, launch
    order of key blocks and bits, its batch and head dims, key and query blocks and the widths of its column
    lists and of the row lists whose slots index the bits; all None without a mask, which compiles the
    variant out."""
    if kt is None:
        return (None,) * 14
    # the bits as 16-bit words: a consumer thread's two bytes of a row in one load and one register
    return (kt.q_full_num, kt.q_full_idx, kt.q_part_num, kt.q_part_idx, kt.q_part_slot, kt.k_order,
            kt.part_bits.view(torch.int16), kt.kv_full_num.shape[0], kt.kv_full_num.shape[1],
            kt.q_full_num.shape[2], kt.n_qblocks, kt.q_full_idx.shape[3], kt.q_part_idx.shape[3],
            kt.kv_part_idx.shape[3])


def alibi_args(alibi_slopes) -> tuple:
    """(slopes, batch stride) of the kernels' ALiBi arguments: slopes (nheads,) serve every batch (stride 0);
    (None, None) without ALiBi, which compiles it out."""
    if alibi_slopes is None:
        return None, None
    return alibi_slopes, (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)


def band_args(pb) -> tuple:
    """The kernels' band as (CAUSAL, left, right): a right side of 0 is CAUSAL, known at compile time (the
    diagonal); a side that is -1 (unbounded) is None, which compiles its edge out."""
    left, right = pb.spec.window
    return right == 0, (left if left >= 0 else None), (right if right > 0 else None)


def softcap_args(pb) -> tuple:
    """(cap_in, cap_out): scale / softcap and softcap / ln 2, or (None, None) without a softcap."""
    return (pb.scalars[1], pb.scalars[2]) if pb.spec.softcap else (None, None)


def _lengths(pb, q, k) -> tuple[int, int]:
    """The kernels' seqlen_q / seqlen_k: the padded lengths, or under varlen the rows of the packed q and k
    (given as one batch), into which they clamp each sequence cu_seqlens describes."""
    return (q.shape[1], k.shape[1]) if pb.varlen else (pb.seqlen_q, pb.seqlen_k)


def _prepare_forward(pb, route: GluonForward, q, k, v, out, lse, fp8: bool = False) -> Prepared:
    from flashattn.kernels.gluon.attn_fwd import attn_fwd_ws_kernel

    tiles = route.tiles
    # packed (route.pack > 1): a work item per (batch, kv head) and tile of its group's packed rows
    heads = pb.nheads // pb.flags["GROUP"] if route.pack > 1 else pb.nheads
    n_bh = pb.batch * heads
    # varlen: at most every sequence's tiles at max_seqlen_q (the kernel reads the exact count), and one
    # program even when no sequence has a row
    n_work = max(host.cdiv(pb.seqlen_q * route.pack, tiles.block_m) * n_bh, 1)
    n_programs = min(n_work, sm_count(q.device)) if route.persistent else n_work
    # Q's and K's head dim padded to the route's width (TMA reads the columns past d as zeros), their
    # descriptors as wide or, at a width that is not a power of two (192), 64 columns wide, the kernel
    # loading and multiplying such chunks one by one; V's and O's, a power of two, as it is
    # (routes.takes_gluon_forward)
    d = route.head_dim
    chunk = d if d & (d - 1) == 0 else 64
    # an FP8 V: K-major (v is kmajor_v's view)
    # V's and O's as wide as dv's padded width (TMA reads zeros past dv and clips O's stores there)
    dv_width = host.block_d(pb.dv)
    v_spec = _kmajor_spec(v, tiles.block_n) if fp8 else _descriptor_spec(v, tiles.block_n, dv_width)
    if route.pack > 1:
        group = pb.flags["GROUP"]
        q_spec = _packed_spec(q, group, route.pack, chunk)
        o_spec = _packed_spec(out, group, route.pack, dv_width)
    else:
        q_spec, o_spec = _descriptor_spec(q, HALF_M, chunk), _descriptor_spec(out, HALF_M, dv_width)
    specs = (q_spec, _descriptor_spec(k, tiles.block_n, chunk), v_spec, o_spec)
    causal, left, right = band_args(pb)
    kwargs = dict(GROUP=pb.flags["GROUP"], HEAD_DIM=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                  STAGES=tiles.num_stages, CAUSAL=causal, DEFER_RELEASE=route.defer_release,
                  HALF_DIAG=route.half_diag, TREES=route.trees, Q_BUFS=route.q_buffers, PACK=route.pack,
                  QK_AHEAD=route.qk_ahead, num_warps=4, maxnreg=route.maxnreg)
    # the LSE: (batch, nheads, seqlen_q), or (nheads, total_q) under varlen
    lse_strides = (0, lse.stride(0)) if pb.varlen else (lse.stride(0), lse.stride(1))
    return Prepared(
        Bound(attn_fwd_ws_kernel, (n_programs,), kwargs), specs,
        (*lse_strides, heads, *_lengths(pb, q, k), pb.scalars[0], n_bh, route.lpt_group, left, right,
         *softcap_args(pb)), _schedule(1) if pb.varlen else None,
    )


def backward_buffers(pb, q) -> tuple[torch.Tensor, torch.Tensor]:
    """(stats, dq_acc). stats: the backward kernel's per-row statistics, which the
    preprocess fills: (2, b·h, sq rounded up to 4) float32, [0] the LSE in base 2, [1] D = rowsum(dO ∘ O);
    varlen: (2, h, rows) with sequence b's rows from 4 · stats_row0[b] on (`varlen_backward_offsets`: the
    tiles of 4 rows before each query sequence), a bound on those offsets' end, the rows between sequences
    unwritten (the kernel counts every row past a sequence's end as a row without keys, whatever its
    stats). The kernel's loader brings both with each (Q, dO) tile through one TMA copy, whose start in the
    innermost dim must be 16-byte aligned (an unaligned one stopped the H200 on an illegal instruction):
    hence the padding. dq_acc: the float32 buffer shaped like q (contiguous) into which the kernel adds dQ,
    zeroed by the preprocess. Two allocations: on the H100's host a view costs what an allocation does
    (~2.7 us), and carving both from one took four."""
    if pb.varlen:
        rows, planes = 4 * (-(-q.shape[0] // 4) + pb.batch), pb.nheads
    else:
        rows, planes = -(-pb.seqlen_q // 4) * 4, pb.batch * pb.nheads
    return (torch.empty(2, planes, rows, dtype=torch.float32, device=q.device),
            torch.empty(*q.shape, dtype=torch.float32, device=q.device))


def backward(pb, route: GluonBackward, q, k, v, dout, stats, dq_acc, dk, dv, softmax_scale: float,
             prepared: Prepared | None = None, alibi_slopes=None, learnable_sink=None, cu_seqlens_q=None,
             cu_seqlens_k=None, varlen_offsets=None, dq_out=None, block_mask=None) -> tuple:
    """dq, dk and dv (dk and dv filled: attention_backward's contract; dq written into dq_out where given)
    and the sink's gradient ((h,) float32, or None without learnable_sink), with the warp-specialised
    backward; stats and dq_acc: as
    `backward_buffers` gives them, filled by the preprocess. prepared: as `forward`'s. Varlen (pb.varlen,
    cu_seqlens and varlen_offsets given: `varlen_backward_offsets`' pair): the packed tensors go to the
    descriptors as one batch, and the kernel gets the key tiles before each sequence. block_mask: a
    block-sparse call's BlockMaskKernelTensors (128 x 128 blocks, padded layout, no band) on attn_bwd.py's
    kernel, whose key tiles walk its column lists (kernels/gluon/sparse_bwd.py). Returns (dq, dk, dv, dsink,
    the launch prepared)."""
    streamed = (q, dout, k, v, dk, dv, dq_acc)
    varlen = (None,) * 10
    if pb.varlen:
        stats_row0, key_tiles = varlen_offsets
        varlen = (cu_seqlens_q, cu_seqlens_k, key_tiles, stats_row0, dk, dv, dk.stride(0), dk.stride(1),
                  dv.stride(0), dv.stride(1))
    split = (None, None)
    if route.group_split > 1:
        if pb.flags["GROUP"] % route.group_split:
            raise FlashAttnError(f"group_split is {route.group_split}; it must divide the GQA group "
                                 f"({pb.flags['GROUP']} query heads per kv head)")
        # the parts' dK and dV, summed in float32, then cast into dk and dv; deterministic: each part adds
        # into kv heads of its own (kv head h, part p: h · group_split + p), one contributor an element,
        # and the parts are summed here in a fixed order
        parts = route.group_split if route.deterministic else 1
        split = tuple(torch.zeros((*t.shape[:-2], t.shape[-2] * parts, t.shape[-1]), dtype=torch.float32,
                                  device=k.device) for t in (k, v))
    # the sink's gradient, added into by the programs
    dsink = None if learnable_sink is None else torch.zeros(pb.nheads, dtype=torch.float32, device=q.device)
    # deterministic: a counter per query head and row (of which each query tile's first row's is used):
    # (b, h, sq), or (h, total_q) under varlen
    lock = (None, 0, 0)
    if route.deterministic:
        rows = q.shape[0] if pb.varlen else pb.seqlen_q
        counters = torch.zeros(pb.nheads * rows * (1 if pb.varlen else pb.batch), dtype=torch.int32,
                               device=q.device)
        lock = (counters, 0 if pb.varlen else pb.nheads * rows, rows)
    # attn_bwd.py's kernel takes the block-sparse arguments (the wide heads' kernels have no such variant)
    sparse = ()
    if not (route.d_qk or route.wide_keys):
        sparse = sparse_backward_args(block_mask)
    elif block_mask is not None:
        raise FlashAttnError("the wide heads' Gluon backward has no block-sparse variant")
    if prepared is None:
        prepared = _prepare_backward(pb, route, *_as_batch(pb, streamed), stats, softmax_scale)
    prepared((*streamed, stats), (*prepared.args, *alibi_args(alibi_slopes), *varlen, *split, learnable_sink,
                                  dsink, *lock, *sparse))
    if route.group_split > 1:
        if route.deterministic:
            split = tuple(acc.view(*t.shape[:-1], route.group_split, t.shape[-1]).sum(-2)
                          for acc, t in zip(split, (k, v), strict=True))
        dk.copy_(split[0])
        dv.copy_(split[1])
    dq = dq_acc.to(q.dtype) if dq_out is None else dq_out.copy_(dq_acc)
    return dq, dk, dv, dsink, prepared


@functools.cache
def _stats_layout():
    from triton.experimental.gluon import language as gl

    # unswizzled: the kernel reads each plane's row back as a plain vector
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)


def _prepare_backward(pb, route: GluonBackward, q, dout, k, v, dk, dv, dq_acc, stats,
                      softmax_scale: float) -> Prepared:
    """The backward's launch: attn_bwd.py's, attn_bwd_dsplit.py's where route.d_qk is set, or
    attn_bwd_keys.py's where route.wide_keys is; all take the same runtime arguments, a program per key tile,
    kv head and part of the GQA group."""
    tiles = route.tiles
    m, n = tiles.block_m, tiles.block_n
    n_tiles = host.cdiv(pb.seqlen_k, n) * pb.batch
    if pb.varlen:
        # a bound on the key tiles of every sequence (the kernel reads the exact list): at most one partial
        # tile per sequence beyond the packed keys' whole tiles; and one program when there are none
        n_tiles = max(min(n_tiles, host.cdiv(k.shape[1], n) + pb.batch), 1)
    stats_spec = (list(stats.shape), list(stats.stride()), [2, 1, m], _stats_layout())
    causal, left, right = band_args(pb)
    common = dict(GROUP=pb.flags["GROUP"], BLOCK_M=m, BLOCK_N=n, STAGES=tiles.num_stages, CAUSAL=causal,
                  SPLIT=route.group_split, num_warps=4, maxnreg=route.maxnreg)
    if route.wide_keys:
        from flashattn.kernels.gluon.attn_bwd_keys import attn_bwd_keys_kernel as kernel

        # Q, K and dK through 256-wide tiles, dO, V and dV through dv's padded width (<= 128), each
        # warpgroup's keys a tile of n / 2 rows, dQ's reduce-adds 64 columns at a time
        dv_w = host.block_d(pb.dv)
        specs = (_descriptor_spec(q, m, 256), _descriptor_spec(dout, m, dv_w),
                 _descriptor_spec(k, n // 2, 256), _descriptor_spec(v, n // 2, dv_w),
                 _descriptor_spec(dk, n // 2, 256), _descriptor_spec(dv, n // 2, dv_w),
                 _descriptor_spec(dq_acc, m, 64, "float32"), stats_spec)
        kwargs = common
    elif route.d_qk:
        from flashattn.kernels.gluon.attn_bwd_dsplit import attn_bwd_dsplit_kernel as kernel

        # Q, K and dK through 256-wide tiles, dO, V and dV through dv's padded width, dQ's reduce-adds 64
        # columns at a time
        dv_w = host.block_d(pb.dv)
        specs = (_descriptor_spec(q, m, 256), _descriptor_spec(dout, m, dv_w), _descriptor_spec(k, n, 256),
                 _descriptor_spec(v, n, dv_w), _descriptor_spec(dk, n, 256), _descriptor_spec(dv, n, dv_w),
                 _descriptor_spec(dq_acc, m, 64, "float32"), stats_spec)
        kwargs = dict(common, D_QK=route.d_qk, DO_STAGES=route.do_stages)
    else:
        from flashattn.kernels.gluon.attn_bwd import attn_bwd_ws_kernel as kernel

        # every tile as wide as d's padded width (dv <= d: routes.takes_gluon_backward),
        # the columns past them read as zeros and clipped from the stores; two warpgroups of half the keys
        width = host.block_d(pb.d)
        specs = (*(_descriptor_spec(t, m, width) for t in (q, dout)),
                 *(_descriptor_spec(t, n // 2, width) for t in (k, v, dk, dv)),
                 _descriptor_spec(dq_acc, m, width // 2, "float32"), stats_spec)
        if route.dq_order_rows % m:
            raise FlashAttnError(f"dq_order_rows is {route.dq_order_rows}; it must be a multiple of the "
                                 f"backward's query rows a step ({m})")
        kwargs = dict(common, HEAD_DIM=width, DEFER_DQ=route.defer_dq, ORDER_M=route.dq_order_rows)
    n_bhk = pb.batch * pb.nheads_k * route.group_split  # the group's parts count as heads of their own
    return Prepared(
        Bound(kernel, (n_tiles * pb.nheads_k * route.group_split,), kwargs), specs,
        (pb.nheads_k, *_lengths(pb, q, k), pb.scalars[0], softmax_scale, n_bhk, route.kv_group, left, right,
         *softcap_args(pb), pb.d, pb.dv), _schedule(2) if pb.varlen else None,
    )
