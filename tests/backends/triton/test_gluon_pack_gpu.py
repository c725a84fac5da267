"""The Gluon forward with a GQA group packed into its query tiles (FA3's pack_gqa; routes.gqa_pack,
GluonForward.pack) on a Hopper GPU (``pytest -m gpu``).

A packed tile's row r is position r // pack of the group's head r % pack, pack being the group padded to a
power of two: groups of 2 to 128 heads (3, 5 and 6 padded, their extra rows computed and never stored; 128 as
several tiles of one position's heads), few and odd query rows, sq != sk both ways, every band and option,
each head dim width, and the varlen layout (a sequence's last positions stored a position's heads at a time,
empty sequences). Every call takes the default packed route, and every case asserts that it did
(so a change in the routing rule cannot turn these into tests of the unpacked kernel) and checks the output,
the LSE and the gradients (the backward reads the packed forward's LSE) against the oracle.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gluon_helpers import check_features, check_varlen, options_for, qkv_dv, takes_gluon_backward
from gluon_helpers import qkv as _qkv
from test_interface import check_against_oracle
from utils import use_tiles

from flashattn.backends.triton import attention, routes

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_routes(monkeypatch):
    """The forward's signature cache emptied: every call derives its route (the Gluon forward's default,
    packed where gqa_pack takes it)."""
    monkeypatch.setattr(attention, "_forward_cache", {})

# (heads, kv heads) -> the pack the route must take
GROUPS = {(8, 2): 4, (6, 2): 4, (10, 2): 8, (12, 2): 8, (16, 2): 8, (32, 1): 32, (64, 1): 64, (128, 1): 128}


def _packed(ws_calls, pack: int) -> None:
    assert ws_calls, "the Gluon forward did not run"
    assert {route.pack for route in ws_calls.routes} == {pack}, ws_calls.routes


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 1023), (17, 17), (17, 300), (40, 1023), (64, 64), (64, 4100),
                                    (33, 20)])
@pytest.mark.parametrize("h, hk", list(GROUPS), ids=lambda g: str(g))
def test_packed_groups(ws_calls, h, hk, sq, sk, causal):
    torch.manual_seed(0)
    check_against_oracle(*_qkv(2, sq, sk, h, hk, 128), causal=causal)
    _packed(ws_calls, GROUPS[(h, hk)])


@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (192, 128), (256, 256), (128, 64)])
@pytest.mark.parametrize("sq, sk", [(17, 1100), (64, 333)])
def test_packed_head_dims(ws_calls, ws_bwd_calls, d, dv, sq, sk):
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 8, 2, d, dv), causal=True,
                   gluon_backward=takes_gluon_backward(d, dv))
    _packed(ws_calls, 4)


@pytest.mark.parametrize("features", ["window", "swa", "softcap", "alibi", "alibi_bh", "sink",
                                      "window+softcap+alibi+sink", "swa+alibi_bh+sink"])
@pytest.mark.parametrize("sq, sk", [(17, 1023), (64, 700), (50, 40)])
@pytest.mark.parametrize("h, hk", [(12, 2), (8, 1)], ids=["gqa6", "mqa8"])
def test_packed_features(ws_calls, ws_bwd_calls, features, h, hk, sq, sk):
    # ALiBi's slopes and the sink's logits differ per row of a packed tile (one head each)
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, h, hk, 128), **options_for(2, h, features))
    _packed(ws_calls, 8)


@pytest.mark.parametrize("window", [(0, 0), (5, 0), (-1, 3), (20, 20), (1030, -1)], ids=str)
def test_packed_window_edges(ws_calls, window):
    # a tile of 16 positions x 4 heads: band edges inside one position's rows and across tiles
    check_against_oracle(*_qkv(2, 64, 1100, 8, 2, 64), window_size=window)
    _packed(ws_calls, 4)


@pytest.mark.parametrize("features", ["causal", "swa+alibi_bh+sink", "window+softcap"])
def test_packed_three_consumers(ws_calls, ws_bwd_calls, monkeypatch, features):
    # 192-row tiles (three consumer warpgroups, serial steps): 48 positions x 4 heads a tile
    use_tiles(monkeypatch, "fwd_ws=192,128,4,3")
    torch.manual_seed(0)
    options = dict(causal=True) if features == "causal" else options_for(2, 8, features)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, 100, 700, 8, 2, 64), **options)
    _packed(ws_calls, 4)
    assert {route.tiles.block_m for route in ws_calls.routes} == {192}


def test_packed_strided_inputs(ws_calls):
    # q, k, v as views of one packed tensor (strides past their heads), out written through the same view
    qkv = torch.randn(2, 40, 12, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
    check_against_oracle(q, k, v, causal=True, wrt=(qkv,))
    _packed(ws_calls, 4)


def test_packed_and_unpacked_agree():
    # without a mask and with whole key tiles, a row's work is the same packed or not (the same keys in the
    # same order, the same instructions per row; its neighbours in the wgmma do not enter its sums): bit for
    # bit the same output and LSE
    q, k, v = (t.detach() for t in _qkv(1, 64, 1024, 8, 2, 128))
    spec = attention.spec_of(q, k, v)
    packed = routes.gluon_forward_route(spec)
    assert packed.pack == 4
    out = {}
    for route in (packed, dataclasses.replace(packed, pack=1)):
        out[route.pack] = attention.attention_forward(q, k, v, softmax_scale=0.1, causal=False, route=route)
    assert torch.equal(out[4][0], out[1][0]) and torch.equal(out[4][1], out[1][1])


# short sequences (mean 24 rows), empty ones, one ending on each kind of tile boundary
PACKED_VARLEN_Q = [0, 1, 17, 64, 5, 33, 0, 2, 40, 32, 16, 80]
PACKED_VARLEN_K = [5, 1, 30, 64, 900, 0, 3, 200, 40, 100, 16, 300]


@pytest.mark.parametrize("features", ["causal", "plain", "swa+alibi_bh+sink", "window+softcap"])
@pytest.mark.parametrize("h, hk, pack", [(8, 2, 4), (12, 2, 8), (32, 1, 32), (64, 1, 64)],
                         ids=["gqa4", "gqa6", "mqa32", "mqa64"])
def test_packed_varlen(ws_calls, ws_bwd_calls, features, h, hk, pack):
    torch.manual_seed(0)
    simple = {"causal": dict(causal=True), "plain": {}}
    options = simple[features] if features in simple else options_for(len(PACKED_VARLEN_Q), h, features)
    check_varlen(ws_calls, ws_bwd_calls, PACKED_VARLEN_Q, PACKED_VARLEN_K, h, hk, 128, **options)
    _packed(ws_calls, pack)
