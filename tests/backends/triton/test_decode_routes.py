"""Decode's routing on the CPU (backends/triton/decode_routes.py, decode.py): the split count for the
programs an SM runs, the merge's packed rows and its loads per round, the key tiles for the program count,
and a tile override's precedence. The kernels' results for these routes: tests/test_kvcache.py and the
GPU tests."""

from __future__ import annotations

import pytest
from utils import use_tiles


@pytest.mark.parametrize(
    "programs, n_tiles, splits",
    [
        (8, 129, 16),  # batch 1, 8 KV heads: one wave of 128 programs on 132 SMs, not two (33 splits)
        (1, 129, 128),  # one program: one wave is 132 splits, capped at 128
        (66, 129, 2),  # exactly half the SMs: still one wave
        (128, 129, 3),  # batch 16: one wave would not split at all; about two waves
        (264, 129, 1),  # two waves without splitting
        (8, 5, 5),  # a short cache: at most one split per key tile
    ],
)
def test_num_splits_heuristic(programs, n_tiles, splits):
    from flashattn.backends.triton.decode_routes import num_splits_heuristic

    assert num_splits_heuristic(programs, n_tiles, 132) == splits


@pytest.mark.parametrize(
    "programs, splits",
    [
        (8, 33),  # batch 1: one wave of 2 x 132 slots
        (128, 2),  # batch 16: two programs an SM hold one wave of 256 without a second
        (256, 3),  # batch 32: about two waves of 264
        (528, 1),  # two waves without splitting
    ],
)
def test_num_splits_plan_for_two_programs_an_sm(programs, splits):
    from flashattn.backends.triton.decode_routes import num_splits_heuristic

    assert num_splits_heuristic(programs, 513, 132, per_sm=2) == splits


@pytest.mark.parametrize("group, sq, merge_rows", [(4, 1, 4), (1, 1, 1), (8, 3, 32), (4, 3, 16), (16, 8, 64)])
def test_the_merge_takes_the_packed_rows(monkeypatch, group, sq, merge_rows):
    from flashattn.backends.triton import decode_routes

    use_tiles(monkeypatch, None)
    # the packed rows' next power of two, within the query block (block_m: at least 16, the rows' power of
    # two up to the tile's cap of 64)
    spec = decode_routes.DecodeSpec(1, 8 * group, 8, sq, 128, 2, False, 65536, sms=132)
    route = decode_routes.decode_route(spec)
    assert route.merge_rows == merge_rows and route.merge_rows <= route.block_m


@pytest.mark.parametrize("merge_rows, splits, chunk",
                         [(4, 16, 16), (4, 3, 4), (16, 16, 4), (1, 2, 2), (4, 33, 16)])
def test_the_merge_loads_at_most_the_splits_power_of_two(merge_rows, splits, chunk):
    from flashattn.backends.triton.decode import merge_chunk

    # 8K floats of partials a round (64 registers a thread), at most 16 splits, at most splits' power of two
    assert merge_chunk(merge_rows, 128, splits) == chunk


def test_an_fp8_cache_at_d128_plans_two_programs_an_sm(monkeypatch):
    from flashattn.backends.triton import decode_routes

    use_tiles(monkeypatch, None)
    for paged in (False, True):
        # b16 and b1 x 8 KV heads, 64K keys: the H200 sweep's best split counts, 2 and about 32
        for batch, splits in ((16, 2), (1, 33)):
            spec = decode_routes.DecodeSpec(batch, 32, 8, 1, 128, 1, paged, 65536, sms=132)
            assert decode_routes.decode_route(spec).num_splits == splits
        # a 16-bit cache keeps one program an SM: 3 and 16 splits
        for batch, splits in ((16, 3), (1, 16)):
            spec = decode_routes.DecodeSpec(batch, 32, 8, 1, 128, 2, paged, 65536, sms=132)
            assert decode_routes.decode_route(spec).num_splits == splits
    # unmeasured head dims keep one
    spec = decode_routes.DecodeSpec(16, 32, 8, 1, 64, 1, False, 65536, sms=132)
    assert decode_routes.decode_route(spec).num_splits == 3


def _decode_tiles(d, element_size, paged, kv_programs):
    from flashattn.backends.triton import decode_routes

    # one query row per program (GQA group 1, seqlen_q 1), kv_programs (batch, kv head) pairs on an H200
    spec = decode_routes.DecodeSpec(kv_programs, 1, 1, 1, d, element_size, paged, 4096, sms=132)
    return decode_routes.decode_tiles_for(spec)


@pytest.mark.parametrize(
    "paged, programs, block_n",
    [
        (True, 8, 128),  # batch 1: few programs, 16 splits each, wide key tiles
        (True, 66, 128),  # still one wave
        (True, 128, 64),  # batch 16 x 8 KV heads: a paged cache reads faster through 64-key tiles
        (False, 128, 128),  # contiguous caches keep the wide tile
    ],
)
def test_decode_tiles_follow_the_program_count(monkeypatch, paged, programs, block_n):
    use_tiles(monkeypatch, None)
    assert _decode_tiles(128, 2, paged, programs).block_n == block_n
    # measured for 16-bit caches at d = 128 only: d = 64 and fp32 keep their tiles
    assert _decode_tiles(64, 2, paged, programs).block_n == 128
    assert _decode_tiles(128, 4, paged, programs).block_n == 64


def test_decode_override_beats_the_program_count(monkeypatch):
    from flashattn.backends.triton.configs import TileConfig

    use_tiles(monkeypatch, "decode_paged=64,128,4,5")
    assert _decode_tiles(128, 2, True, 128) == TileConfig(64, 128, 4, 5)
