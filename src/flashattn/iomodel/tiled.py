"""HBM traffic of our tiled kernels: forward, backward (preprocess, dK/dV, dQ) and split-KV decode.

Every kernel has the same shape: a program keeps one tile on chip (the "stationary" operand, read and written
once) and streams tiles of a shared operand (K/V in the forward and dQ kernels, Q/dO in the dK/dV kernel).
Stationary traffic is exact. Streamed traffic has two estimates:

- no-L2 (upper bound): every tile load a program issues is a DRAM read;
- L2-aware: a program grid runs axis 0 (the tile index) fastest, so all programs reading one head's K/V run
  together, step through it in the same order and share each tile through L2. If the in-flight heads' streamed
  data fits in the usable L2 it is read from DRAM once per head; otherwise once per wave of concurrently
  resident programs (machine.sms x ctas_per_sm). This is the estimate the +-20% target is checked against.

Tail tiles are counted by the rows actually loaded (masked loads fetch nothing), FLOPs by whole tiles (the
tensor cores compute them anyway) with the head dim padded to a power of two, as the kernels pad it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashattn.backends.triton import decode_routes, routes
from flashattn.backends.triton.configs import decode_programs_per_sm, tile_config
from flashattn.backends.triton.host import block_d
from flashattn.iomodel.estimate import H200, AttnShape, IOEstimate, Machine, combine

LSE_BYTES = 4  # LSE and delta are fp32 per row
PARTIAL_BYTES = 4  # split-KV partial outputs are fp32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_headdim(d: int) -> int:
    """Head dim as the kernels compute it: the next power of two, at least 16 (the smallest tl.dot)."""
    return block_d(d)


def route_spec(shape: AttnShape) -> routes.Spec:
    """The routing spec of `shape` on the H200 (16-bit unless dtype_bytes is 4, TMA-ready tensors): the IO
    model follows the launchers' own routes, so it follows tuning without a second copy of the numbers."""
    return routes.Spec(shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.seqlen_k,
                       shape.headdim, shape.headdim, "float32" if shape.dtype_bytes == 4 else "bfloat16",
                       window=shape.bounds)


def kernel_tiles(kernel: str, headdim: int, seqlen: int | None = None) -> tuple[int, int]:
    """(block_m, block_n) of the Triton kernel `kernel` ("fwd", "dkdv" or "dq") at `headdim` on a GPU, from
    the launchers' tile table (expert overrides included); `seqlen` (max of sq, sk; None: long) picks the
    short-sequence rows."""
    cfg = tile_config(kernel, padded_headdim(headdim), True, seqlen)
    return cfg.block_m, cfg.block_n


@dataclass(frozen=True)
class _Stream:
    """What the programs of one group (one kv head, say) stream from their shared operand."""

    tiles: float  # tile loads issued, after block sparsity
    rows_no_l2: float  # rows loaded, every load from DRAM
    rows_l2: float  # rows loaded from DRAM when L2 serves re-reads
    fits: bool  # whether the in-flight groups' streamed data fits in usable L2


def _stream(block_rows: list[int], programs: list[list[tuple[int, int]]], row_bytes: int, *, density: float,
            n_groups: int, concurrency: int, l2_bytes: float) -> _Stream:
    """Count one group's streamed loads. `programs` are in launch order, each a list of [lo, hi) block
    spans into `block_rows`."""
    prefix = [0]
    for rows in block_rows:
        prefix.append(prefix[-1] + rows)
    tiles = sum(hi - lo for spans in programs for lo, hi in spans)
    rows_no_l2 = sum(prefix[hi] - prefix[lo] for spans in programs for lo, hi in spans)

    def union_rows(progs: list[list[tuple[int, int]]]) -> float:
        # Coverage count per block via a difference array: O(programs + blocks) instead of their product.
        diff = [0] * (len(block_rows) + 1)
        for spans in progs:
            for lo, hi in spans:
                diff[lo] += 1
                diff[hi] -= 1
        covered, total = 0, 0.0
        for rows, delta in zip(block_rows, diff[:-1], strict=True):
            covered += delta
            if covered:
                # With an i.i.d. block-sparse mask a block is fetched if any of its `covered` users keeps it.
                total += rows * (1.0 - (1.0 - density) ** covered)
        return total

    whole = union_rows(programs)
    # A group's programs are contiguous in launch order; groups straddling the resident window are live too.
    in_flight = min(n_groups, cdiv(concurrency, max(1, len(programs))) + 1)
    fits = in_flight * whole * row_bytes <= l2_bytes
    if fits:
        rows_l2 = whole
    else:
        rows_l2 = sum(union_rows(programs[i:i + concurrency]) for i in range(0, len(programs), concurrency))
    return _Stream(tiles * density, rows_no_l2 * density, rows_l2, fits)


def _blocks(total: int, block: int) -> list[int]:
    return [min(block, total - i * block) for i in range(cdiv(total, block))]


def _span(lo: int, hi: int, block: int) -> tuple[int, int]:
    return (lo // block, cdiv(hi, block)) if hi > lo else (0, 0)


def _query_major(shape: AttnShape, block_m: int, block_n: int, machine: Machine, ctas_per_sm: int,
                 pack: int = 1) -> _Stream:
    """K/V streamed by programs over (m-block, query head): the forward and the dQ kernel. pack > 1 (the
    Gluon forward's packed GQA tiles): the m-blocks are of a kv head's packed rows (position r // pack of
    head r % pack), one program each for the whole group."""
    sq, sk = shape.seqlen_q, shape.seqlen_k
    rows = sq * pack
    spans = [_span(*shape.visible_keys(i * block_m // pack, min(sq, ((i + 1) * block_m - 1) // pack + 1)),
                   block_n) for i in range(cdiv(rows, block_m))]
    # grid = (m-blocks, b*h): the query heads of one GQA group are adjacent on axis 1, so their programs are
    # one contiguous run sharing the kv head.
    programs = [[s] for _ in range(1 if pack > 1 else shape.group) for s in spans]
    row_bytes = 2 * shape.headdim * shape.dtype_bytes
    return _stream(_blocks(sk, block_n), programs, row_bytes, density=shape.density,
                   n_groups=shape.batch * shape.nheads_k, concurrency=machine.sms * ctas_per_sm,
                   l2_bytes=machine.l2_effective)


def forward_io(shape: AttnShape, *, block_m: int | None = None, block_n: int | None = None,
               machine: Machine = H200, ctas_per_sm: int = 1) -> IOEstimate:
    """The forward kernel: grid (cdiv(sq, block_m), b*h); Q tile read once, K/V streamed, O, LSE written.

    Tile sizes default to the route the launcher takes (routes.forward_route); a forward of few query rows
    that the launcher runs on the split-KV decode kernel (decode_routes.SplitForward) is `decode_io`'s,
    unless tile sizes are given (the dense kernel's traffic at those tiles).
    """
    spec = route_spec(shape)
    route = routes.forward_route(spec)
    if isinstance(route, decode_routes.SplitForward):
        if block_m is None and block_n is None:
            return decode_io(shape, machine=machine)
        route = routes.gluon_forward_route(spec)
    tiles = route.tiles
    default_m, default_n = tiles.block_m, tiles.block_n
    block_m, block_n = block_m or default_m, block_n or default_n
    b, h, hk, sq, sk, d, e = (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.seqlen_k,
                              shape.headdim, shape.dtype_bytes)
    pack = route.pack if isinstance(route, routes.GluonForward) else 1
    kv = _query_major(shape, block_m, block_n, machine, ctas_per_sm, pack)
    row = 2 * d * e
    q_bytes = b * h * sq * d * e
    out_bytes = q_bytes + b * h * sq * LSE_BYTES
    kv_once = b * hk * sk * row
    return IOEstimate(
        name="fwd",
        bytes_read=round(q_bytes + b * hk * kv.rows_l2 * row),
        bytes_read_no_l2=round(q_bytes + b * hk * kv.rows_no_l2 * row),
        bytes_written=out_bytes,
        flops=round(b * hk * kv.tiles * 2 * (2 * block_m * block_n * padded_headdim(d))),
        flops_convention=shape.convention_flops(),
        peak_extra_bytes=out_bytes,
        detail=dict(tiles=b * hk * kv.tiles, kv_passes_no_l2=b * hk * kv.rows_no_l2 * row / kv_once,
                    kv_passes_l2=b * hk * kv.rows_l2 * row / kv_once, l2_fits=kv.fits,
                    block_m=block_m, block_n=block_n, pack=pack),
    )


def ws_backward_tiles(shape: AttnShape) -> tuple[int, int] | None:
    """(block_m, block_n) of the warp-specialised backward where the backward's route takes it at `shape` on
    the H200 (routes.backward_route), else None (block-sparse masks never take it)."""
    if shape.density < 1.0:
        return None
    route = routes.backward_route(route_spec(shape))
    return (route.tiles.block_m, route.tiles.block_n) if isinstance(route, routes.GluonBackward) else None


def _qdo_stream(shape: AttnShape, block_m: int, block_n: int, machine: Machine, ctas_per_sm: int) -> _Stream:
    """Q, dO, lse and delta streamed by key-major programs: grid (cdiv(sk, block_n), b*h_k), each program
    looping over the group's query heads and the m-blocks that see its keys."""
    sq, sk, g = shape.seqlen_q, shape.seqlen_k, shape.group
    n_m = cdiv(sq, block_m)
    m_spans = [_span(*shape.visible_rows(j * block_n, min(sk, (j + 1) * block_n)), block_m)
               for j in range(cdiv(sk, block_n))]
    programs = [[(gi * n_m + lo, gi * n_m + hi) for gi in range(g)] for lo, hi in m_spans]
    row = 2 * shape.headdim * shape.dtype_bytes + 2 * LSE_BYTES
    return _stream(_blocks(sq, block_m) * g, programs, row, density=shape.density,
                   n_groups=shape.batch * shape.nheads_k, concurrency=machine.sms * ctas_per_sm,
                   l2_bytes=machine.l2_effective)


def _ws_backward_io(shape: AttnShape, block_m: int, block_n: int, machine: Machine, ctas_per_sm: int
                    ) -> IOEstimate:
    """FlashAttention-3's backward (kernels/gluon/attn_bwd.py): the preprocess also zeroes a float32 dQ
    buffer; one key-major kernel streams Q and dO as the dK/dV kernel does and reduce-adds each (query tile,
    key tile) pair's dQ into the buffer (5 matmuls per pair); a last pass converts the buffer to dQ."""
    b, h, hk, sq, sk, d, e = (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.seqlen_k,
                              shape.headdim, shape.dtype_bytes)
    q_bytes = b * h * sq * d * e  # also O, dO, dQ
    kv_bytes = b * hk * sk * d * e  # also each of dK, dV
    stats = b * h * sq * LSE_BYTES
    acc = b * h * sq * d * 4  # the float32 dQ buffer
    pre = IOEstimate("bwd.preprocess", bytes_read=2 * q_bytes, bytes_written=stats + acc, flops=0,
                     peak_extra_bytes=stats + acc)
    qdo = _qdo_stream(shape, block_m, block_n, machine, ctas_per_sm)
    row = 2 * d * e + 2 * LSE_BYTES
    tiles = b * hk * qdo.tiles
    # a reduce-add reads and writes a (block_m, d) float32 tile in L2; DRAM sees the buffer read and written
    # back once while it stays there, every reduce-add's read when nothing does
    main = IOEstimate(
        "bwd.ws",
        bytes_read=round(2 * kv_bytes + b * hk * qdo.rows_l2 * row + acc),
        bytes_read_no_l2=round(2 * kv_bytes + b * hk * qdo.rows_no_l2 * row + tiles * block_m * d * 4),
        bytes_written=2 * kv_bytes + acc,
        flops=round(tiles * 5 * (2 * block_m * block_n * padded_headdim(d))),
        peak_extra_bytes=2 * kv_bytes,
        detail=dict(tiles=tiles, l2_fits=qdo.fits, block_m=block_m, block_n=block_n,
                    qdo_passes_no_l2=qdo.rows_no_l2 / (shape.group * sq),
                    qdo_passes_l2=qdo.rows_l2 / (shape.group * sq)),
    )
    post = IOEstimate("bwd.postprocess", bytes_read=acc, bytes_written=q_bytes, flops=0,
                      peak_extra_bytes=q_bytes)
    return combine("bwd", [pre, main, post], flops_convention=round(2.5 * shape.convention_flops()))


def _grouped_backward_io(shape: AttnShape, groups: int, machine: Machine, ctas_per_sm: int) -> IOEstimate:
    """A backward whose float32 dQ buffer would pass routes.DQ_BUFFER_CAP, as the launcher runs it: one group
    of query heads at a time (routes.backward_head_groups) with its KV heads, writing its gradients into
    the whole ones in place; or one KV head's query heads in parts, each part's gradients then copied (the
    parts' dK and dV summed in float32, not modelled: a KV head's K/V-sized traffic). Peak: the whole
    gradients beside one group's peak (less its own gradients where written in place)."""
    nheads = shape.nheads // groups
    part = replace(shape, nheads=nheads, nheads_k=max(nheads // shape.group, 1))
    one = backward_io(part, machine=machine, ctas_per_sm=ctas_per_sm)
    b, d, e = shape.batch, shape.headdim, shape.dtype_bytes
    grads = (b * shape.nheads * shape.seqlen_q + 2 * b * shape.nheads_k * shape.seqlen_k) * d * e
    kw = dict(flops_convention=round(2.5 * shape.convention_flops()), groups=groups)
    if nheads >= shape.group:
        own = (b * part.nheads * part.seqlen_q + 2 * b * part.nheads_k * part.seqlen_k) * d * e
        return combine("bwd", [one] * groups, peak_extra_bytes=grads + one.peak_extra_bytes - own, **kw)
    copy = IOEstimate("bwd.copy", bytes_read=grads // groups, bytes_written=grads // groups, flops=0,
                      peak_extra_bytes=0)
    return combine("bwd", [one, copy] * groups, peak_extra_bytes=grads + one.peak_extra_bytes, **kw)


def backward_io(shape: AttnShape, *, block_m1: int | None = None, block_n1: int | None = None,
                block_m2: int | None = None, block_n2: int | None = None, machine: Machine = H200,
                ctas_per_sm: int = 1, kernel: str | None = None) -> IOEstimate:
    """The backward our launcher runs at `shape`, or `kernel`: "ws" (the warp-specialised Gluon backward:
    preprocess, one kernel, postprocess; block_m1, block_n1 tile it) or "triton" (preprocess, dK/dV kernel,
    dQ kernel, no atomics; (block_m1, block_n1) tile the dK/dV kernel, (block_m2, block_n2) the dQ kernel).
    Nothing N x N either way; tiles default as the launcher.
    """
    if kernel not in (None, "ws", "triton"):
        raise ValueError(f"kernel must be None, 'ws' or 'triton', got {kernel!r}")
    groups = 1 if shape.density < 1.0 else routes.backward_head_groups(
        shape.batch * shape.nheads * shape.seqlen_q * shape.headdim * 4, shape.nheads, shape.nheads_k, False)
    if kernel is None and groups > 1:
        return _grouped_backward_io(shape, groups, machine, ctas_per_sm)
    ws_tiles = ws_backward_tiles(shape)
    if kernel == "ws" or (kernel is None and ws_tiles is not None):
        block_m, block_n = ws_tiles or (64, 128)  # "ws" forced where the launcher would not take it
        return _ws_backward_io(shape, block_m1 or block_m, block_n1 or block_n, machine, ctas_per_sm)
    triton = routes.triton_backward_route(route_spec(shape))
    m1, n1 = triton.dkdv_tiles.block_m, triton.dkdv_tiles.block_n
    m2, n2 = triton.dq_tiles.block_m, triton.dq_tiles.block_n
    block_m1, block_n1, block_m2, block_n2 = block_m1 or m1, block_n1 or n1, block_m2 or m2, block_n2 or n2
    b, h, hk, sq, sk, d, e = (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.seqlen_k,
                              shape.headdim, shape.dtype_bytes)
    g, dpad = shape.group, padded_headdim(d)
    q_bytes = b * h * sq * d * e  # also O, dO, dQ
    kv_bytes = b * hk * sk * d * e  # also each of dK, dV
    stats = b * h * sq * LSE_BYTES  # lse or delta

    pre = IOEstimate("bwd.preprocess", bytes_read=2 * q_bytes, bytes_written=stats, flops=0,
                     peak_extra_bytes=stats)

    # dK/dV: key-major programs streaming Q and dO tiles plus lse and delta
    row1 = 2 * d * e + 2 * LSE_BYTES
    qdo = _qdo_stream(shape, block_m1, block_n1, machine, ctas_per_sm)
    dkdv = IOEstimate(
        "bwd.dkdv",
        bytes_read=round(2 * kv_bytes + b * hk * qdo.rows_l2 * row1),
        bytes_read_no_l2=round(2 * kv_bytes + b * hk * qdo.rows_no_l2 * row1),
        bytes_written=2 * kv_bytes,
        flops=round(b * hk * qdo.tiles * 4 * (2 * block_m1 * block_n1 * dpad)),
        peak_extra_bytes=2 * kv_bytes,
        detail=dict(tiles=b * hk * qdo.tiles, l2_fits=qdo.fits, block_m=block_m1, block_n=block_n1,
                    qdo_passes_no_l2=qdo.rows_no_l2 / (g * sq), qdo_passes_l2=qdo.rows_l2 / (g * sq)),
    )

    # dQ: the forward's structure with Q, dO, lse and delta as the stationary tile.
    kv = _query_major(shape, block_m2, block_n2, machine, ctas_per_sm)
    row2 = 2 * d * e
    stationary = 2 * q_bytes + 2 * stats
    dq = IOEstimate(
        "bwd.dq",
        bytes_read=round(stationary + b * hk * kv.rows_l2 * row2),
        bytes_read_no_l2=round(stationary + b * hk * kv.rows_no_l2 * row2),
        bytes_written=q_bytes,
        flops=round(b * hk * kv.tiles * 3 * (2 * block_m2 * block_n2 * dpad)),
        peak_extra_bytes=q_bytes,
        detail=dict(tiles=b * hk * kv.tiles, l2_fits=kv.fits, block_m=block_m2, block_n=block_n2,
                    kv_passes_no_l2=kv.rows_no_l2 / sk,
                    kv_passes_l2=kv.rows_l2 / sk),
    )
    return combine("bwd", [pre, dkdv, dq], flops_convention=round(2.5 * shape.convention_flops()))


def forward_backward_io(shape: AttnShape, *, machine: Machine = H200, ctas_per_sm: int = 1) -> IOEstimate:
    """One training step's attention: forward then backward, with the default tile sizes."""
    fwd = forward_io(shape, machine=machine, ctas_per_sm=ctas_per_sm)
    bwd = backward_io(shape, machine=machine, ctas_per_sm=ctas_per_sm)
    return combine("fwd+bwd", [fwd, bwd])


def decode_tiles(headdim: int, dtype_bytes: int, paged: bool = False, rows: int = 1, kv_programs: int = 1,
                 machine: Machine = H200) -> tuple[int, int]:
    """(block_m cap, block_n) of the split-KV kernel on a GPU for `rows` packed query rows in each of
    `kv_programs` (batch, kv head) pairs, from the launcher's own route (decode_routes.decode_tiles_for)."""
    spec = decode_routes.DecodeSpec(kv_programs, rows, 1, 1, headdim, dtype_bytes, paged, 1, sms=machine.sms)
    cfg = decode_routes.decode_tiles_for(spec)
    return cfg.block_m, cfg.block_n


def default_num_splits(batch: int, nheads_k: int, keys: int, machine: Machine = H200, *, rows: int = 1,
                       block_m: int = 64, block_n: int = 128, headdim: int = 128, dtype_bytes: int = 2
                       ) -> int:
    """The split count the launcher picks (decode_routes.num_splits_heuristic) for `rows` packed query rows
    (GQA group x seqlen_q) per (batch, kv head) and a cache of `keys` keys of `dtype_bytes` at `headdim`."""
    m_blocks = cdiv(rows, decode_routes.query_block(rows, block_m))
    per_sm = decode_programs_per_sm(block_d(headdim), dtype_bytes)
    return decode_routes.num_splits_heuristic(batch * nheads_k * m_blocks, cdiv(keys, block_n) + 1,
                                              machine.sms, per_sm)


def decode_io(shape: AttnShape, *, num_splits: int | None = None, block_n: int | None = None,
              page_size: int | None = None, machine: Machine = H200) -> IOEstimate:
    """Split-KV decoding (flash-decoding): one program per (batch, kv head, split), then a combine kernel.

    Each program reads its chunk of K/V once for all query heads of its GQA group and writes fp32 partials;
    the combine kernel merges them. With one split the program writes the output itself: no combine.
    Paged caches add the block-table reads. Only keys the mask lets through are read (a window shortens the
    chunk range; causal with a few query rows changes nothing). Tiles and split count default to the
    launcher's.
    """
    b, h, hk, sq, d, e = (shape.batch, shape.nheads, shape.nheads_k, shape.seqlen_q, shape.headdim,
                          shape.dtype_bytes)
    lo, hi = shape.visible_keys(0, sq)
    keys = hi - lo
    rows = shape.group * sq  # query rows per program: the whole group's heads
    block_m, default_n = decode_tiles(d, e, page_size is not None, rows, b * hk, machine)
    block_n = block_n or default_n
    splits = num_splits or default_num_splits(b, hk, keys, machine, rows=rows, block_m=block_m,
                                              block_n=block_n, headdim=d, dtype_bytes=e)
    # the launcher caps the splits at the key tiles + 1; trailing splits may get no tile (the kernel gives
    # each cdiv(tiles, splits) tiles) yet still run: they read q and write an empty partial
    splits = min(splits, cdiv(keys, block_n) + 1)
    chunk = cdiv(cdiv(keys, splits), block_n) * block_n  # splits start on tile boundaries
    chunks = [(s, min(hi, s + chunk)) for s in range(lo, hi, chunk)] or [(lo, lo)]
    programs = b * hk * splits

    kv_read = b * hk * keys * 2 * d * e
    q_read = programs * rows * d * e
    table_read = 0
    if page_size:
        pages = sum((end - 1) // page_size - start // page_size + 1 for start, end in chunks if end > start)
        table_read = b * hk * pages * 4  # int32 block-table entries
    out = b * h * sq * d * e
    lse = b * h * sq * LSE_BYTES
    partials = programs * rows * (d + 1) * PARTIAL_BYTES  # out and lse per split, fp32
    rows_pad = padded_headdim(rows)  # tl.dot needs >= 16 rows: a small group is padded
    tiles = b * hk * sum(cdiv(end - start, block_n) for start, end in chunks)
    flops = tiles * 2 * (2 * rows_pad * block_n * padded_headdim(d))
    conv = 4 * b * h * sq * keys * d
    detail = dict(num_splits=splits, chunk=chunk, tiles=tiles)
    read = kv_read + q_read + table_read
    if splits == 1:
        return IOEstimate("decode", bytes_read=read, bytes_written=out + lse, flops=flops,
                          flops_convention=conv, peak_extra_bytes=out + lse, detail=detail)
    split = IOEstimate("decode.split", bytes_read=read, bytes_written=partials,
                       flops=flops, flops_convention=conv, peak_extra_bytes=partials, detail=detail)
    merge = IOEstimate("decode.combine", bytes_read=partials, bytes_written=out + lse, flops=0,
                       peak_extra_bytes=out + lse)
    return combine("decode", [split, merge], **detail)


def leaves(estimate: IOEstimate) -> list[IOEstimate]:
    """The kernel launches under an estimate, in order (an estimate without parts is one launch)."""
    if not estimate.parts:
        return [estimate]
    return [leaf for part in estimate.parts for leaf in leaves(part)]

