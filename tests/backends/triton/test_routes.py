"""Routing (flashattn.backends.triton.routes): which kernel a call runs is a pure function of its spec.

Pure host logic, tested on the CPU: the Gluon kernels take the 16-bit padded-layout calls at d = 64 and 128
with or without a window, softcap, ALiBi or sink, dropout and the rest route to the Triton kernels, the
process environment changes nothing, the tile table's short and causal
rows apply where they say, expert overrides replace rows, and the IO model and the launchers follow the same
routes. The kernels on every route are compiled for sm_90 by test_sm90_compile.py and run on the GPU by
`pytest -m gpu`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from route_specs import CAUSAL
from route_specs import spec as _spec
from utils import INTERPRET, LaunchRecorder, use_tiles

from flashattn import flash_attn_func
from flashattn.backends.triton import attention, configs, decode_routes, routes, tma
from flashattn.backends.triton.configs import TileConfig, tile_config
from flashattn.errors import FlashAttnError
from flashattn.iomodel import AttnShape, backward_io, forward_io
from flashattn.iomodel.tiled import ws_backward_tiles

# -------------------------------------------------------------- which kernel family


@pytest.mark.parametrize("kw", [
    dict(), dict(window=CAUSAL), dict(headdim=64, headdim_v=64),
    dict(headdim=64, headdim_v=64, window=CAUSAL),
    dict(seqlen_q=65, seqlen_k=65, dtype="float16"), dict(seqlen_q=100, seqlen_k=1100, window=CAUSAL),
    dict(seqlen_q=16384, seqlen_k=16384), dict(nheads_k=4), dict(nheads_k=1),
    # the options that are compile-time variants of the Gluon kernels, alone and together
    dict(window=(64, 0)), dict(window=(-1, 8)), dict(window=(100, 100)), dict(window=(0, 0)),
    dict(window=(64, -1)), dict(window=(4095, 0), seqlen_q=1000),
    dict(window=(1023, 0), headdim=64, headdim_v=64),
    dict(softcap=True), dict(alibi=True), dict(sink=True), dict(softcap=True, headdim=64, headdim_v=64),
    dict(window=(255, 0), softcap=True, alibi=True, sink=True), dict(window=CAUSAL, alibi=True, nheads_k=1),
    # head dims below the tiles' widths (TMA reads zeros past them): d padded to 64 or 128, dv <= d
    dict(headdim=96, headdim_v=96), dict(headdim_v=96), dict(headdim=40, headdim_v=40),
    dict(headdim=80, headdim_v=64, window=CAUSAL), dict(varlen=True, headdim=96, headdim_v=96),
    dict(headdim=192, headdim_v=192),  # 256-wide tiles: O, 256 wide, is staged in Q's buffer
], ids=str)
def test_calls_the_gluon_kernels_take(kw):
    spec = _spec(**kw)
    assert isinstance(routes.forward_route(spec), routes.GluonForward)
    assert isinstance(routes.backward_route(spec), routes.GluonBackward)


@pytest.mark.parametrize("kw, split", [
    # at most 16 query rows: the split-KV forward at any batch
    (dict(seqlen_q=1, seqlen_k=1, dtype="float16"), True), (dict(seqlen_q=16, batch=64), True),
    (dict(seqlen_q=4, seqlen_k=32768, nheads=32, nheads_k=1, window=CAUSAL), True),
    (dict(seqlen_q=7, window=(100, -1), softcap=True, alibi=True), True),
    # 17..64 rows: where the Gluon forward's (batch, head) tiles leave SMs idle
    (dict(seqlen_q=64, nheads=32, nheads_k=8), True), (dict(seqlen_q=64, batch=8, nheads=32), False),
    (dict(seqlen_q=17, batch=33, nheads=4), False), (dict(seqlen_q=65), False),
    # what the decode kernel lacks (a sink, dv != d), more rows than keys, varlen: the Gluon forward
    (dict(seqlen_q=8, sink=True), False), (dict(seqlen_q=8, seqlen_k=4), False),
    (dict(seqlen_q=8, varlen=True, tokens_q=8), False), (dict(seqlen_q=8, headdim_v=64), False),
], ids=str)
def test_few_query_rows_take_the_split_kv_forward(kw, split):
    spec = _spec(**kw)
    route = routes.forward_route(spec)
    assert isinstance(route, decode_routes.SplitForward if split else routes.GluonForward)
    assert isinstance(routes.backward_route(spec), routes.GluonBackward)
    # off Hopper (or without TMA-ready tensors) the Triton forward, as before
    ampere = dataclasses.replace(spec, capability=(8, 0))
    assert isinstance(routes.forward_route(ampere), routes.TritonForward)


@pytest.mark.parametrize("kw", [
    dict(headdim=64, headdim_v=128), dict(headdim=40, headdim_v=128),
    dict(headdim=32, headdim_v=32), dict(headdim=24, headdim_v=24),
    dict(dropout=True), dict(dropout=True, window=(64, 0)), dict(dtype="float32"),
    dict(dtype="float32", softcap=True), dict(varlen=True, dropout=True),
    dict(varlen=True, seqlen_k=0), dict(varlen=True, seqlen_q=0),
    dict(aligned=False), dict(aligned=False, sink=True), dict(capability=(8, 0)), dict(cuda=False),
], ids=str)
def test_every_other_call_routes_to_the_triton_kernels(kw):
    spec = _spec(**kw)
    assert isinstance(routes.forward_route(spec), routes.TritonForward)
    assert isinstance(routes.backward_route(spec), routes.TritonBackward)


@pytest.mark.parametrize("kw", [
    dict(), dict(window=CAUSAL), dict(window=(255, 0), softcap=True, alibi=True, sink=True),
    dict(headdim=64, headdim_v=64), dict(nheads_k=1, window=CAUSAL),
], ids=str)
def test_varlen_takes_the_gluon_kernels(kw):
    # both mask a tile's rows past its sequence (and store a sequence's last rows by masked stores)
    spec = _spec(varlen=True, tokens_q=16384, **kw)
    assert isinstance(routes.forward_route(spec), routes.GluonForward)
    assert isinstance(routes.backward_route(spec), routes.GluonBackward)
    assert not spec.tma  # the Triton kernels' descriptors would read the next sequence instead of zeros


@pytest.mark.parametrize("page, kw, reads", [
    (128, dict(), True), (256, dict(window=CAUSAL, sink=True), True),
    (4096, dict(headdim=64, headdim_v=64), True),
    (128, dict(headdim=192, headdim_v=128), True), (64, dict(headdim=256, headdim_v=256), True),
    # a page that splits the route's key tile (128 at d <= 192), the Triton forward, an FP8 call: gathered
    (64, dict(), False), (16, dict(), False), (192, dict(), False), (128, dict(dropout=True), False),
    (128, dict(dtype="float32"), False), (128, dict(cuda=False), False),
    (128, dict(dtype="float8_e4m3fn", out_dtype="bfloat16"), False),
], ids=str)
def test_paged_prefill_reads_pages_where_the_key_tiles_fit_them(page, kw, reads):
    spec = _spec(varlen=True, tokens_q=4096, page_size=page, **kw)
    assert routes.reads_pages(spec, routes.forward_route(spec)) is reads
    assert not routes.reads_pages(dataclasses.replace(spec, page_size=0), routes.forward_route(spec))


def test_varlen_dq_buffer_counts_the_packed_rows():
    # 64 documents of up to 4K in 64K tokens: a float32 dQ of 64K x 16 x 128 (512 MiB) fits the cap, where
    # batch x max_seqlen_q rows would be 4x over it
    spec = _spec(varlen=True, batch=64, seqlen_q=4096, seqlen_k=4096, nheads=16, nheads_k=16, tokens_q=65536)
    assert routes.dq_buffer_bytes(spec) == 65536 * 16 * 128 * 4 <= routes.DQ_BUFFER_CAP
    assert isinstance(routes.backward_route(spec), routes.GluonBackward)
    over = dataclasses.replace(spec, tokens_q=65537)
    assert isinstance(routes.backward_route(over), routes.TritonBackward)


@pytest.mark.parametrize("kw", [dict(), dict(window=CAUSAL), dict(window=(1023, 0), softcap=True, sink=True),
                                dict(varlen=True, alibi=True)], ids=str)
def test_d256_takes_the_gluon_forward_and_the_wide_gluon_backward(kw):
    # 64-key steps beside one Q buffer (two of 128 x 256 and the ring pass the shared memory), hence no
    # deferred release and no half-diagonal step; FP8 takes the same 64-key steps beside two (its 8-bit Q and
    # K/V tiles leave room for them). The backward: attn_bwd_dsplit.py on 64 x 64 steps, two Q stages and one
    # dO stage (two pass 227 KiB)
    spec = _spec(headdim=256, headdim_v=256, **kw)
    route = routes.forward_route(spec)
    assert isinstance(route, routes.GluonForward)
    assert (route.tiles.block_m, route.tiles.block_n, route.tiles.num_stages) == (128, 64, 2)
    assert (route.q_buffers, route.defer_release, route.half_diag, route.trees) == (1, False, False, 3)
    bwd = routes.backward_route(spec)
    assert isinstance(bwd, routes.GluonBackward)
    assert (bwd.d_qk, bwd.do_stages, bwd.tiles.block_m, bwd.tiles.block_n, bwd.tiles.num_stages) == \
        (256, 1, 64, 64, 2)
    # its deterministic variant (the dQ writer's two rounds), with a learnable sink the Triton backward
    fixed = routes.backward_route(dataclasses.replace(spec, deterministic=True, sink=False))
    assert isinstance(fixed, routes.GluonBackward) and fixed.deterministic and fixed.d_qk == 256
    assert fixed.group_split == 1
    assert isinstance(routes.backward_route(dataclasses.replace(spec, deterministic=True, sink=True)),
                      routes.TritonBackward)
    if not kw.get("varlen"):
        fp8 = routes.forward_route(dataclasses.replace(spec, dtype="float8_e4m3fn", out_dtype="bfloat16",
                                                       seqlen_q=8192, seqlen_k=8192))
        assert (fp8.tiles.block_n, fp8.q_buffers, fp8.defer_release) == (64, 2, True)


@pytest.mark.parametrize("d, dv, block_n, d_qk", [
    (192, 128, 128, "keys"), (160, 128, 128, "keys"), (128, 64, 128, 0), (256, 128, 64, 256),
    (224, 128, 64, 256), (96, 64, 128, 0), (40, 64, 128, None), (192, 64, 128, "keys"), (200, 96, 64, 256),
    (160, 104, 128, "keys"), (136, 40, 128, "keys"), (256, 200, 64, 256),
    (160, 160, 64, 256)])
def test_dv_below_d_takes_the_gluon_forward(d, dv, block_n, d_qk):
    # Q and K padded to the tile width, V and O to theirs (no wider: O is staged in Q's buffer); the tiles are
    # the padded d's. The backward: at width 192 beside dv 33..128 attn_bwd_keys.py ("keys": 128 keys, 32-row
    # steps), at width 256 the d-split kernel at its (width, padded dv) pairs, two dO stages beside dv's 128
    # (d_qk 256), attn_bwd.py at d padded to 64 or 128 beside dv <= d (d_qk 0), else the Triton one (None)
    spec = _spec(headdim=d, headdim_v=dv, window=CAUSAL)
    route = routes.forward_route(spec)
    assert isinstance(route, routes.GluonForward) and route.tiles.block_n == block_n
    bwd = routes.backward_route(spec)
    if d_qk is None:
        assert isinstance(bwd, routes.TritonBackward)
    elif d_qk == "keys":
        assert isinstance(bwd, routes.GluonBackward) and bwd.wide_keys and bwd.d_qk == 192
        assert (bwd.tiles.block_m, bwd.tiles.block_n) == (32, 128)
    else:
        assert isinstance(bwd, routes.GluonBackward) and bwd.d_qk == d_qk and not bwd.wide_keys
        if d_qk:
            assert bwd.do_stages == (2 if dv <= 128 else 1)


@pytest.mark.parametrize("d, dv", [(192, 128), (160, 104), (136, 64)])
def test_the_128_key_wide_backward_route(d, dv):
    # attn_bwd_keys.py: 32-row steps, 128 keys, Q/K 192 wide beside dv up to 128; the default route there,
    # the d-split kernel an explicit one beside dv padded to 128
    spec = _spec(headdim=d, headdim_v=dv, window=CAUSAL)
    route = routes.wide_keys_backward_route(spec)
    assert route.wide_keys and route.d_qk == 192
    assert (route.tiles.block_m, route.tiles.block_n) == (32, 128)
    assert routes.backward_route(spec) == route
    if dv > 64:
        dsplit = routes.dsplit_backward_route(spec)
        assert (dsplit.wide_keys, dsplit.d_qk, dsplit.tiles.block_n) == (False, 192, 64)
    else:
        with pytest.raises(FlashAttnError, match="wide-head Gluon backward takes"):
            routes.dsplit_backward_route(spec)


@pytest.mark.parametrize("kw", [dict(headdim=256, headdim_v=128), dict(headdim=192, headdim_v=192),
                                dict(headdim=128), dict(headdim=192, deterministic=True, sink=True),
                                dict(headdim=192, headdim_v=32), dict(headdim=192, dropout=True),
                                dict(headdim=192, dtype="float32"), dict(headdim=192, aligned=False)],
                         ids=str)
def test_the_128_key_wide_backward_route_refuses_other_calls(kw):
    with pytest.raises(FlashAttnError, match="128-key wide-head backward"):
        routes.wide_keys_backward_route(_spec(**{"headdim_v": 128, **kw}))


def test_wide_backward_shared_memory():
    # what the kernel allocates (sm90_compile_check builds each pair within the limit): 225 KiB at dv = 256
    # on one dO stage, where a second would need 257
    tiles = tile_config("bwd_ws", 256, True)
    for dv, stages, kib in ((128, 2, 209), (256, 1, 225), (256, 2, 257)):
        spec = _spec(headdim=256, headdim_v=dv)
        assert routes._dsplit_smem(spec, tiles, stages) == kib * 1024


@pytest.mark.parametrize("text", ["128,64,4,2", "64,128,4,2", "64,64,4,4"])
def test_the_wide_gluon_backward_refuses_tiles_it_cannot_run(monkeypatch, text):
    # 64 query rows and 64 keys only, and Q stages that fit beside one dO stage
    use_tiles(monkeypatch, f"bwd_ws={text}")
    with pytest.raises(FlashAttnError, match="wide-head Gluon backward"):
        routes.backward_route(_spec(headdim=256, headdim_v=256))


@pytest.mark.parametrize("d, dtype, width", [
    (40, "bfloat16", 64), (64, "bfloat16", 64), (96, "float16", 128), (128, "bfloat16", 128),
    (129, "bfloat16", 192), (160, "float16", 192), (192, "bfloat16", 192), (193, "bfloat16", 256),
    (256, "bfloat16", 256), (192, "float8_e4m3fn", 256), (160, "float8_e4m3fn", 256)])
def test_the_gluon_forward_pads_q_and_k_to_its_widths(d, dtype, width):
    # 16-bit heads of 129..192 take 192-wide tiles (three 64-wide chunks), not 256: FA3's widths
    spec = _spec(headdim=d, headdim_v=128 if d > 128 else 64, dtype=dtype)
    assert routes.gluon_head_dim(spec) == width
    if dtype != "float8_e4m3fn":
        assert routes.forward_route(spec).head_dim == width


@pytest.mark.parametrize("d, dv, tiles, q_buffers", [
    (128, 128, "128,128,4,2", 2), (64, 64, "192,128,4,3", 2), (256, 256, "128,32,4,2", 2),
    (256, 256, "128,64,4,2", 1), (192, 128, "128,128,4,2", 1), (192, 128, "128,64,4,3", 2),
    (192, 64, "128,128,4,2", 2)])
def test_the_gluon_forward_keeps_two_q_buffers_where_they_fit(monkeypatch, d, dv, tiles, q_buffers):
    # two Q buffers (the next tile's Q prefetched, its release deferred) unless they and the K/V ring pass
    # the shared memory; one buffer is released at its tile's end (a deferred release would wait forever)
    use_tiles(monkeypatch, f"fwd_ws={tiles}")
    route = routes.forward_route(_spec(headdim=d, headdim_v=dv, window=CAUSAL))
    assert (route.q_buffers, route.defer_release) == (q_buffers, q_buffers == 2)


def test_the_default_tiles_take_two_q_buffers_where_they_fit():
    # the shipped rows' shared memory: one Q buffer beside d = 192's 128-key ring and d = 256's 64-key one
    for d, dv, q_buffers in ((64, 64, 2), (128, 128, 2), (128, 64, 2), (192, 128, 1), (192, 64, 2),
                             (256, 256, 1), (256, 128, 2)):
        for window in ((-1, -1), CAUSAL):
            route = routes.forward_route(_spec(headdim=d, headdim_v=dv, window=window))
            assert route.q_buffers == q_buffers


def test_the_gluon_backward_leaves_calls_whose_dq_buffer_passes_the_cap():
    # b * sq * h * d * 4 bytes of float32 dQ: 128K tokens at h = 16, d = 128 is 1 GiB, past the cap
    fits = _spec(seqlen_q=65536, seqlen_k=65536, nheads=16, nheads_k=16)
    assert routes.dq_buffer_bytes(fits) == routes.DQ_BUFFER_CAP
    assert isinstance(routes.backward_route(fits), routes.GluonBackward)
    over = dataclasses.replace(fits, seqlen_q=65537, seqlen_k=65537)
    assert isinstance(routes.backward_route(over), routes.TritonBackward)


def test_routes_ignore_the_environment(monkeypatch):
    # the tuning switches of old are gone: a route depends on its spec alone
    spec = _spec(window=CAUSAL)
    before = routes.forward_route(spec), routes.backward_route(spec)
    for name in ("FLASHATTN_WS", "FLASHATTN_WS_BWD", "FLASHATTN_TMA", "FLASHATTN_WS_GRID",
                 "FLASHATTN_SCHEDULE", "FLASHATTN_FWD_TREES", "FLASHATTN_FWD_HALF_DIAG",
                 "FLASHATTN_BWD_DEFER_DQ", "FLASHATTN_CONFIG"):
        monkeypatch.setenv(name, "0")
    assert (routes.forward_route(spec), routes.backward_route(spec)) == before


# -------------------------------------------------------------- route options


def test_gluon_forward_options_follow_the_mask_and_the_consumers():
    causal = routes.forward_route(_spec(headdim=64, headdim_v=64, window=CAUSAL))
    assert causal.half_diag and causal.persistent and causal.defer_release
    full = routes.forward_route(_spec(headdim=64, headdim_v=64, seqlen_q=8192, seqlen_k=8192))
    assert not full.half_diag
    # three consumer warpgroups (192-row tiles) reduce the row statistics as chains, two as trees
    assert full.tiles.block_m == 3 * routes.HALF_M
    assert full.trees == 0 and full.maxnreg == routes.MAXNREG_THREE
    two = routes.forward_route(_spec())
    assert two.tiles.block_m == 2 * routes.HALF_M and two.trees == 3 and two.maxnreg == routes.MAXNREG_TWO


@pytest.mark.parametrize("window, half", [
    ((-1, -1), False), (CAUSAL, True), ((64, 0), True), ((-1, 8), True), ((100, 100), True),
    ((64, -1), False),
])
def test_the_half_diagonal_step_follows_a_right_edge(window, half):
    # a warpgroup's last key tile may be half outside the band wherever the band has a right edge
    assert routes.forward_route(_spec(window=window)).half_diag is half


@pytest.mark.parametrize("kw, pack", [
    # few query rows: the group's heads fill the tile (padded to a power of two)
    (dict(seqlen_q=64, batch=8, nheads=32, nheads_k=8), 4),
    (dict(seqlen_q=64, batch=8, nheads=32, nheads_k=1), 32),
    (dict(seqlen_q=17, batch=33, nheads=12, nheads_k=2), 8), (dict(seqlen_q=1, nheads=128, nheads_k=1), 128),
    (dict(seqlen_q=100, nheads=16, nheads_k=2, window=CAUSAL), 8),
    (dict(seqlen_q=64, nheads=6, nheads_k=2, window=(100, 37), softcap=True, alibi=True, sink=True), 4),
    # rows that fill their tiles unpacked (0.9 of the packed share or more), no group, or no packed variant
    (dict(seqlen_q=1000, nheads=16, nheads_k=2), 1), (dict(seqlen_q=2048), 1), (dict(seqlen_q=128), 1),
    (dict(seqlen_q=64, nheads=4, nheads_k=4), 1), (dict(seqlen_q=64, nheads=512, nheads_k=1), 1),
    # varlen: at the sequences' mean length, groups up to 64 (a tile's rows whole positions)
    (dict(seqlen_q=300, varlen=True, batch=10, tokens_q=640, nheads=8), 4),
    (dict(seqlen_q=3000, varlen=True, batch=2, tokens_q=4000, nheads=8), 1),
    (dict(seqlen_q=30, varlen=True, batch=10, tokens_q=200, nheads=128, nheads_k=1), 1),
], ids=str)
def test_the_gluon_forward_packs_a_gqa_group_where_it_fills_the_tiles(kw, pack):
    spec = _spec(**kw)
    route = routes.gluon_forward_route(spec)
    assert route.pack == pack
    if pack > 1:
        # the half step's halves assume a row per position
        assert not route.half_diag
    assert routes.gluon_forward_route(spec, packed=False).pack == 1
    # the default forward route: packed wherever it is the Gluon forward (not the split-KV forward's calls)
    default = routes.forward_route(spec)
    assert default == route or isinstance(default, decode_routes.SplitForward)


def test_fp8_forwards_keep_their_groups_unpacked():
    spec = _spec(seqlen_q=64, nheads=32, nheads_k=8, dtype="float8_e4m3fn", out_dtype="bfloat16")
    assert not routes.takes_gqa_pack(spec) and routes.gluon_forward_route(spec).pack == 1


def test_packed_launch_groups_count_kv_heads():
    # under a band the launch order groups work items so that their keys fit the L2 budget: a packed item
    # streams its kv head's keys whole
    spec = _spec(seqlen_q=64, seqlen_k=65536, batch=8, nheads=32, nheads_k=8, window=CAUSAL)
    route = routes.gluon_forward_route(spec)
    assert route.pack == 4
    assert route.lpt_group == max(1, routes.L2_BUDGET // (65536 * 256 * 2))


@pytest.mark.parametrize("window, consumers", [
    ((1023, 0), 2), ((1023, 1024), 2), ((4095, 4096), 3), ((-1, 8), 3), ((64, -1), 3), (CAUSAL, 3),
    ((-1, -1), 3),
])
def test_the_d64_forward_tiles_a_band_as_causal_at_its_width(window, consumers):
    # 16K tokens: the causal rows take two consumer warpgroups up to a 4K band width, three past it
    spec = _spec(headdim=64, headdim_v=64, seqlen_q=16384, seqlen_k=16384, window=window)
    assert routes.forward_route(spec).tiles.block_m == consumers * routes.HALF_M


@pytest.mark.parametrize("kw", [dict(window=CAUSAL), dict(window=(1023, 0)), dict(window=(64, -1)),
                                dict(softcap=True), dict(alibi=True)], ids=str)
def test_the_d64_backward_takes_64_row_steps_under_a_mask_softcap_or_alibi(kw):
    # 128-row steps spilled 0.4-1.1 KB with a softcap or ALiBi; a sink alone holds nothing more per step
    route = routes.backward_route(_spec(headdim=64, headdim_v=64, seqlen_q=8192, seqlen_k=8192, **kw))
    assert route.tiles.block_m == 64 and route.defer_dq
    plain = routes.backward_route(_spec(headdim=64, headdim_v=64, seqlen_q=8192, seqlen_k=8192, sink=True))
    assert plain.tiles.block_m == 128 and not plain.defer_dq


def test_gluon_backward_defers_dq_on_64_row_steps_at_d64():
    for window in ((-1, -1), CAUSAL):
        route = routes.backward_route(_spec(headdim=64, headdim_v=64, window=window))
        assert route.defer_dq == (route.tiles.block_m == 64)
        assert not routes.backward_route(_spec(window=window)).defer_dq  # d = 128


@pytest.mark.parametrize("nheads, nheads_k, split", [
    (32, 1, 8), (32, 8, 2), (32, 4, 4), (16, 2, 4), (6, 1, 3), (12, 4, 1), (8, 4, 1), (4, 4, 1), (5, 1, 1),
    (7, 1, 1),
])
def test_the_gluon_backward_splits_a_gqa_group_into_parts_of_two_or_more_heads(nheads, nheads_k, split):
    # the largest divisor of the group up to min(8, group / 2)
    spec = _spec(nheads=nheads, nheads_k=nheads_k, window=CAUSAL)
    assert routes.gluon_backward_route(spec).group_split == split


def test_the_group_split_stays_off_where_its_buffers_pass_the_cap():
    # float32 dK and dV: 2 x 4 bytes x (b x sk x h_k x d); 32/8 at 64K tokens is 512 MiB
    fits = _spec(nheads=32, nheads_k=8, seqlen_q=16384, seqlen_k=16384)
    assert routes.gluon_backward_route(fits).group_split == 2
    big = dataclasses.replace(fits, seqlen_q=65536, seqlen_k=65536)
    assert routes.gluon_backward_route(big).group_split == 1


def test_launch_order_groups_heads_only_under_a_band():
    assert routes.forward_route(_spec()).lpt_group == 1
    banded = routes.forward_route(_spec(window=(256, 0), nheads=32, nheads_k=32))
    # as many heads as keep their streamed K/V within the L2 budget
    stream = 2048 * 256 * 2
    assert banded.lpt_group == min(32, routes.L2_BUDGET // stream) > 1


@pytest.mark.parametrize("kw, tma", [
    (dict(dropout=True), True),  # d = 128, 3 stages, 16-bit, aligned, sm90: descriptors
    (dict(dropout=True, headdim=64, headdim_v=64), False),  # measured faster on pointers
    (dict(window=(64, 0), headdim=256, headdim_v=256), False),  # 2-stage tiles: ptxas crashes on them
    (dict(window=(64, 0), aligned=False), False),
    (dict(window=(64, 0), varlen=True), False),  # a tile would read the next sequence, not zeros
    (dict(window=(64, 0), dtype="float32"), False),
    (dict(window=(64, 0), capability=(8, 0)), False),
])
def test_triton_forward_takes_descriptors_where_they_pay(kw, tma):
    route = routes.triton_forward_route(_spec(**kw))
    assert route.tma is tma


@pytest.mark.parametrize("headdim", [160, 192, 224, 256, 96])
@pytest.mark.parametrize("varlen", [False, True])
def test_softcap_over_a_padded_wide_head_runs_one_stage(headdim, varlen):
    # the 2-stage forward with a softcap over a padded 256-wide head faulted on the H200 (misaligned
    # address, flash_attn's varlen tests at d 160); one stage ran clean. d 256 itself and no softcap keep
    # the table's row, and so does the interpreter
    spec = _spec(headdim=headdim, headdim_v=headdim, varlen=varlen, softcap=True, aligned=False)
    row = tile_config("fwd", spec.block_d, True, spec.longest)
    tiles = routes.triton_forward_route(spec).tiles
    padded_wide = 128 < headdim < 256
    assert row.num_stages > 1
    assert tiles == (dataclasses.replace(row, num_stages=1) if padded_wide else row)
    assert routes.triton_forward_route(dataclasses.replace(spec, softcap=False)).tiles == row
    assert routes.triton_forward_route(dataclasses.replace(spec, cuda=False)).tiles.num_stages == \
        tile_config("fwd", spec.block_d, False).num_stages


def test_a_route_is_a_printable_value():
    route = routes.forward_route(_spec())
    assert route.kernel == "gluon" and "GluonForward(tiles=TileConfig(" in repr(route)
    assert routes.forward_route(_spec(dropout=True)).kernel == "triton"
    assert hash(route) == hash(routes.forward_route(_spec()))


# -------------------------------------------------------------- the tile table


@pytest.mark.parametrize("kernel, d", sorted(configs._H200))
def test_short_rows_apply_up_to_their_limit_only(kernel, d):
    long_row = configs._H200[(kernel, d)]
    limit, short_row = configs._H200_SHORT.get((kernel, d), (0, long_row))
    assert tile_config(kernel, d, True) == long_row  # no length given: the long row
    assert tile_config(kernel, d, True, 1) == (short_row if limit else long_row)
    assert tile_config(kernel, d, True, limit) == (short_row if limit else long_row)
    assert tile_config(kernel, d, True, limit + 1) == long_row
    assert tile_config(kernel, d, True, 10**6) == long_row


@pytest.mark.parametrize("kernel, d", sorted(configs._H200_SHORT_CAUSAL))
def test_causal_short_rows_apply_to_causal_calls_up_to_their_limit(kernel, d):
    limit, causal_row = configs._H200_SHORT_CAUSAL[(kernel, d)]
    assert tile_config(kernel, d, True, 1, causal=True) == causal_row
    assert tile_config(kernel, d, True, limit, causal=True) == causal_row
    assert tile_config(kernel, d, True, limit + 1, causal=True) == configs._H200[(kernel, d)]
    # without the mask the plain short rows hold
    assert tile_config(kernel, d, True, limit) != causal_row or limit == 0


def test_the_interpreter_takes_small_unequal_tiles():
    # CPU tests cross tile, tail and diagonal boundaries at small sizes
    route = routes.forward_route(_spec(cuda=False, window=(64, 0)))
    assert route.tiles.block_m != route.tiles.block_n and route.tiles.block_m <= 32


def test_overrides_replace_rows(monkeypatch):
    use_tiles(monkeypatch, "fwd=32,32,4,2")
    assert tile_config("fwd", 128, True, 1024) == TileConfig(32, 32, 4, 2)
    # a fifth number caps the registers
    use_tiles(monkeypatch, "dkdv=32,128,8,3,128")
    assert tile_config("dkdv", 64, True, 4096) == TileConfig(32, 128, 8, 3, 128)
    assert tile_config("fwd", 128, True, 1024) == configs._H200_SHORT[("fwd", 128)][1]


@pytest.mark.parametrize("text", ["fwd=1", "fwd", "fwd=a,b,c,d", "fwd=1,2,3,4,5,6"])
def test_malformed_overrides_are_refused(text):
    from flashattn import config

    with pytest.raises(ValueError, match="expected kernel=block_m,block_n,num_warps,num_stages"):
        config.parse_tiles(text)


@pytest.mark.parametrize("spec, d", [("128,16,4,4", 64), ("192,256,4,3", 64), ("64,128,4,3", 64),
                                     ("256,128,4,3", 64), ("128,128,4,1", 64), ("192,32,4,2", 256)])
def test_the_gluon_forward_refuses_tiles_it_cannot_run(monkeypatch, spec, d):
    # an override the kernel cannot run fails loudly (three consumers' Q tiles at d = 256 overflow the
    # shared memory)
    use_tiles(monkeypatch, f"fwd_ws={spec}")
    with pytest.raises(ValueError, match=f"fwd_ws={spec} is not a config of the Gluon forward at d = {d}"):
        routes.forward_route(_spec(headdim=d, headdim_v=d))


@pytest.mark.parametrize("spec, d, dv", [("128,128,4,3", 192, 128), ("128,64,4,3", 256, 256),
                                         ("192,128,4,3", 128, 128)])
def test_the_gluon_forward_refuses_tiles_past_the_shared_memory(monkeypatch, spec, d, dv):
    # one Q buffer and the K/V ring: 48 + 3 x 80 KiB at d = 192, 64 + 3 x 64 at d = 256, 48 + 3 x 64 for
    # three consumers at d = 128
    use_tiles(monkeypatch, f"fwd_ws={spec}")
    with pytest.raises(ValueError, match=f"fwd_ws={spec} needs .* KiB of shared memory at d = {d}"):
        routes.forward_route(_spec(headdim=d, headdim_v=dv))


@pytest.mark.parametrize("spec", ["128,128,4,3", "192,128,4,2", "128,128,4,2", "128,64,4,3", "192,32,4,2"])
def test_the_gluon_forward_takes_tiles_it_can_run(monkeypatch, spec):
    use_tiles(monkeypatch, f"fwd_ws={spec}")
    route = routes.forward_route(_spec(window=CAUSAL))
    assert route.tiles == TileConfig.parse(spec)
    assert route.half_diag is (route.tiles.block_n == 128)  # the half step splits a 128-key tile


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_launches_carry_the_register_cap(monkeypatch):
    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_kernel"):
        kernel = getattr(attention, name)
        monkeypatch.setattr(attention, name, LaunchRecorder(kernel, calls, options=("num_warps", "maxnreg")))
    use_tiles(monkeypatch, "fwd=32,16,4,1,96;dkdv=16,32,4,1,80")
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16, requires_grad=True) for _ in range(3))
    flash_attn_func(q, k, v, causal=True).sum().backward()
    # forward, then the backward's dK/dV role and its dQ role (no override: no cap)
    assert [opts["maxnreg"] for _, opts in calls] == [96, 80, None]


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("d, dv, block_dv", [(40, 8, 64), (40, 24, 64), (40, 16, 16), (40, 40, 64),
                                             (64, 32, 32), (8, 40, 64)])
def test_launches_widen_masked_value_tiles_narrower_than_the_head(monkeypatch, d, dv, block_dv):
    # host.block_dv: a masked V tile narrower than q's and k's read shared memory out of bounds on the H200
    calls = []
    for name in ("attn_fwd_kernel", "attn_bwd_kernel"):
        kernel = getattr(attention, name)
        monkeypatch.setattr(attention, name, LaunchRecorder(kernel, calls, options=("BLOCK_D", "BLOCK_DV")))
    q, k = (torch.randn(1, 20, 2, d, dtype=torch.float16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 20, 2, dv, dtype=torch.float16, requires_grad=True)
    flash_attn_func(q, k, v).sum().backward()
    assert len(calls) == 3  # the forward, the backward's dK/dV and dQ roles
    assert all(opts == {"BLOCK_D": max(16, 1 << (d - 1).bit_length()), "BLOCK_DV": block_dv}
               for _, opts in calls)


# -------------------------------------------------------------- who else follows the routes


@pytest.mark.parametrize("shape", [
    AttnShape(16, 16, 1024, 128), AttnShape(16, 16, 1024, 128, causal=True), AttnShape(4, 16, 4096, 64),
    AttnShape(4, 16, 4096, 64, causal=True), AttnShape(16, 16, 1024, 128, window=(256, 0)),
    AttnShape(1, 16, 8192, 256, causal=True),
], ids=str)
def test_the_io_model_follows_the_routes(shape):
    from flashattn.iomodel.tiled import route_spec

    spec = route_spec(shape)
    fwd = routes.forward_route(spec)
    assert forward_io(shape).detail["block_m"] == fwd.tiles.block_m
    bwd = routes.backward_route(spec)
    gluon = isinstance(bwd, routes.GluonBackward)
    assert (ws_backward_tiles(shape) is not None) == gluon
    leaves = [leaf.name for leaf in backward_io(shape).parts]
    assert ("bwd.ws" in leaves) == gluon


def test_specs_from_tensors(monkeypatch):
    # what the launcher derives: alignment from the tensors, capability from the device
    q, k, v = (torch.randn(1, 130, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    pb = attention._problem(q, k, v, 0.1, True, (-1, -1), 0.0, None, 0.0, 0, 0, None, None, None, None)
    assert pb.spec == _spec(seqlen_q=130, seqlen_k=130, nheads_k=4, window=CAUSAL, cuda=False,
                            capability=(0, 0), aligned=False)
    assert tma.aligned(q, k, v)
    flat = torch.randn(k.numel() + 1, dtype=torch.bfloat16)
    assert not tma.aligned(q, flat[1:].view(k.shape), v)  # base not 16-byte aligned
    wide = torch.randn(*k.shape[:-1], 129, dtype=torch.bfloat16)[..., :128]
    assert not tma.aligned(q, wide, v)  # a row stride of 258 bytes
    assert tma.aligned(k.transpose(1, 2).contiguous().transpose(1, 2))  # heads-major


def test_decode_routes():
    spec = decode_routes.DecodeSpec(batch=1, nheads=32, nheads_k=8, seqlen_q=1, headdim=128, element_size=2,
                             paged=False, capacity=65536)
    route = decode_routes.decode_route(spec)
    # batch 1 fills one wave with splits: floor(SMs / programs)
    assert route.num_splits == spec.sms // 8 and route.block_m == 16
    many = dataclasses.replace(spec, batch=64)
    assert decode_routes.decode_route(many).num_splits == 1  # 512 programs already fill two waves
    assert decode_routes.decode_route(dataclasses.replace(spec, num_splits=3)).num_splits == 3
    # a window shortens the key span a split may cover
    narrow = decode_routes.decode_route(dataclasses.replace(spec, window=(127, 0)))
    assert narrow.num_splits <= -(-(128 + 16) // narrow.tiles.block_n) + 1


@pytest.mark.parametrize("headdim, headdim_v, window, rows", [
    (128, 128, (-1, -1), 192), (96, 128, (-1, -1), 192), (128, 128, CAUSAL, 128), (128, 128, (1023, 0), 128),
    (64, 64, (-1, -1), 192), (256, 256, (-1, -1), 128),
])
def test_fp8_forward_rows(headdim, headdim_v, window, rows):
    # FP8 at d = 128 without a band: three consumer warpgroups of 64 rows (its own table row); under a band,
    # and at the other widths, the 16-bit rows; the 16-bit d = 128 call keeps two
    spec = _spec(headdim=headdim, headdim_v=headdim_v, seqlen_q=8192, seqlen_k=8192, window=window,
                 dtype="float8_e4m3fn", out_dtype="bfloat16")
    route = routes.forward_route(spec)
    assert isinstance(route, routes.GluonForward) and route.tiles.block_m == rows
    sixteen = routes.forward_route(dataclasses.replace(spec, dtype="bfloat16", out_dtype=None))
    assert sixteen.tiles.block_m == (192 if headdim == 64 else 128)
