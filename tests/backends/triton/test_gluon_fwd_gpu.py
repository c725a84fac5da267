"""The warp-specialised Gluon forward (kernels/gluon/attn_fwd.py) on a Hopper GPU (``pytest -m gpu``).

Every case asserts that the call really took the kernel (the `ws_calls` spy on backends/triton/gluon.py's
launcher, conftest.py), so a change in the routes cannot turn these into tests of the Triton kernels. The
route's options (the grid, the half-diagonal step, the deferred release, the consumer count, the QK^T
issued a step ahead) are each run against the oracle through route variants. Same tolerance rule as
everywhere (tests/utils.py), output and LSE.
"""

from __future__ import annotations

import pytest
import torch
from gluon_helpers import VARLEN_K, VARLEN_Q, check_features, check_varlen, options_for
from gluon_helpers import qkv as _qkv
from gluon_helpers import vary_routes as _vary_routes
from test_interface import check_against_oracle
from utils import use_tiles

from flashattn import flash_attn_func
from flashattn.backends.triton import attention, routes

pytestmark = pytest.mark.gpu


# the kernel takes d = 64 and 128 at any length; d = 64 past 1K takes three consumers (past 4K under causal
# masking)
SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 113), (1, 1023), (2049, 1537),
           (128, 128), (256, 320)]
CAUSAL_SEQLENS = [(1, 1537), (17, 1100), (1100, 17), (1025, 1025), (2049, 1537), (1537, 2049), (113, 2000),
                  (1300, 1300), (1152, 1152), (1, 1), (113, 1023), (1023, 113), (1024, 1024)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", SEQLENS)
def test_seqlens(ws_calls, sq, sk, d):
    check_against_oracle(*_qkv(2, sq, sk, 4, 4, d), causal=False)
    assert ws_calls, "the warp-specialised forward did not run"


# causal: up to 4K two consumer warpgroups, past it three (192-row tiles, tails of 4200 - 4032 and 4500 - 4416
# rows)
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (1024, 1024), (300, 700),
                                    (1025, 1025), (1300, 1300), (2049, 1537), (1537, 2049), (1, 2000),
                                    (4200, 4200), (4500, 4100), (4100, 4500)])
def test_seqlens_causal_d64(ws_calls, sq, sk):
    check_against_oracle(*_qkv(2, sq, sk, 4, 2, 64), causal=True)
    assert ws_calls, "the warp-specialised forward did not run"


@pytest.mark.parametrize("sq, sk", CAUSAL_SEQLENS)
def test_seqlens_causal(ws_calls, sq, sk):
    check_against_oracle(*_qkv(2, sq, sk, 4, 4, 128), causal=True)
    assert ws_calls, "the warp-specialised forward did not run"


@pytest.mark.parametrize("grid", ["persistent", "tiles"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_both_grids(ws_calls, monkeypatch, grid, causal):
    # more tiles than SMs, so each persistent program takes several from the shared counter
    _vary_routes(monkeypatch, forward=dict(persistent=grid == "persistent"))
    check_against_oracle(*_qkv(3, 2100, 2100, 24, 8, 128), causal=causal, grads=False)
    assert ws_calls


# the default route (three consumers at d = 64 past N = 1K, or 4K causal), its half-diagonal step and its
# deferred release turned off alone, and each consumer count forced (d = 64 only: three spill at d = 128)
ORDERS = {
    "default": ({}, None),
    "full-diagonal": (dict(half_diag=False), None),
    "tile-end-release": (dict(defer_release=False), None),
    "three-consumers": ({}, "fwd_ws=192,128,4,3"),
    "two-consumers": ({}, "fwd_ws=128,128,4,3"),
    # each next key tile's QK^T issued before this one's softmax (fwd_steps.ahead_steps): 64-key steps, whose
    # two S tiles fit beside O (at 128 keys they spill)
    "qk-ahead": (dict(qk_ahead=True), "fwd_ws=128,64,4,2"),
}
_D64_ONLY = ("three-consumers", "two-consumers")


@pytest.mark.parametrize("order, d", [(order, d) for order in ORDERS for d in (64, 128)
                                      if not (order in _D64_ONLY and d == 128)])
@pytest.mark.parametrize("sq, sk, causal", [(2100, 2100, True), (1400, 3, True), (1400, 700, True),
                                            (700, 1400, True), (333, 333, True), (17, 1023, False)])
def test_tile_boundary_orders(ws_calls, monkeypatch, order, d, sq, sk, causal):
    # each persistent program takes several tiles (some without keys): a Q buffer returned before its O
    # store has read it, or never returned, shows as a wrong or hanging result; so does a half diagonal step
    # that drops a visible key or releases a stage twice (sq != sk shifts the diagonal both ways; 333 ends
    # mid-tile), or a third consumer's rows or barrier counts gone wrong
    fields, tiles = ORDERS[order]
    _vary_routes(monkeypatch, forward=fields)
    if tiles:
        use_tiles(monkeypatch, tiles)
    check_against_oracle(*_qkv(3, sq, sk, 24, 8, d), causal=causal, grads=False)
    assert ws_calls
    assert all(route.qk_ahead == (order == "qk-ahead") for route in ws_calls.routes)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (1, 1023), (2049, 1537)])
@pytest.mark.parametrize("features", ["window", "swa", "softcap", "alibi", "sink",
                                      "window+softcap+alibi+sink"])
def test_qk_ahead_features(ws_calls, ws_bwd_calls, monkeypatch, features, sq, sk, d):
    # the QK^T-ahead steps with every score option: a key step's scores taken for another's, or one step
    # fewer or more, shows against the oracle (n_k of 1, 2 and many per tile; windows leave some tiles none)
    use_tiles(monkeypatch, "fwd_ws=128,64,4,2")
    _vary_routes(monkeypatch, forward=dict(qk_ahead=True))
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, d), **options_for(2, 4, features))
    assert ws_calls.routes and all(route.qk_ahead for route in ws_calls.routes)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_qk_ahead_varlen(ws_calls, ws_bwd_calls, monkeypatch, causal):
    use_tiles(monkeypatch, "fwd_ws=128,64,4,2")
    _vary_routes(monkeypatch, forward=dict(qk_ahead=True))
    torch.manual_seed(0)
    check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, 4, 2, 128, causal=causal)
    assert ws_calls.routes and all(route.qk_ahead for route in ws_calls.routes)


def test_d64_many_tiles(ws_calls):
    check_against_oracle(*_qkv(3, 2100, 1900, 24, 8, 64), causal=False, grads=False)
    assert ws_calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(8, 2), (8, 1), (12, 4)], ids=["gqa4", "mqa", "gqa3"])
def test_gqa(ws_calls, h, hk, causal):
    check_against_oracle(*_qkv(2, 700, 1100, h, hk, 128), causal=causal)
    assert ws_calls


def test_fp16_and_packed(ws_calls):
    check_against_oracle(*_qkv(2, 1000, 1200, 4, 2, 128, torch.float16), causal=True)
    qkv = torch.randn(2, 1777, 3, 8, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    check_against_oracle(*qkv.unbind(2), causal=True, wrt=(qkv,))
    assert len(ws_calls) == 2


@pytest.mark.parametrize("sq, sk", [(1300, 100), (1400, 3)])
def test_causal_rows_without_keys(ws_calls, sq, sk):
    # sq > sk, bottom-right aligned: the first sq - sk rows see no key -> out 0, lse +inf, dq 0
    floor = "rounding" if sk <= 3 else None  # see tests/test_interface.py::test_fully_masked_rows
    out, lse, (dq, _, _) = check_against_oracle(*_qkv(1, sq, sk, 2, 2, 128), causal=True, grad_floor=floor)
    assert ws_calls
    n = sq - sk
    assert (out[:, :n] == 0).all() and torch.isposinf(lse[:, :, :n]).all() and (dq[:, :n] == 0).all()
    assert torch.isfinite(lse[:, :, n:]).all() and not torch.isnan(out).any()


def test_extreme_logits(ws_calls):
    q, k, v = _qkv(1, 500, 1200, 2, 2, 128)
    with torch.no_grad():
        q.mul_(30.0)
    check_against_oracle(q, k, v, causal=True, grads=False)
    assert ws_calls


def test_same_as_triton_forward(ws_calls, monkeypatch):
    q, k, v = _qkv(4, 2048, 2048, 8, 8, 128)
    out_ws, lse_ws, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    monkeypatch.setattr(attention, "_forward_cache", {})
    monkeypatch.setattr(routes, "forward_route", routes.triton_forward_route)
    out_tr, lse_tr, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert len(ws_calls) == 1
    torch.testing.assert_close(lse_ws, lse_tr, atol=1e-3, rtol=0)
    torch.testing.assert_close(out_ws, out_tr, atol=2e-2, rtol=0)


def test_ineligible_calls_keep_triton(ws_calls):
    q, k, v = _qkv(1, 256, 256, 2, 2, 128)
    flash_attn_func(q, k, v, window_size=(64, 0), dropout_p=0.1)
    # d = 59: rows of 118 bytes, which no TMA descriptor takes (d 80 and 96 are padded Gluon calls)
    flash_attn_func(*_qkv(1, 256, 256, 2, 2, 59), softcap=5.0)
    flash_attn_func(*_qkv(1, 256, 256, 2, 2, 128, torch.float32), window_size=(-1, 8))
    assert not ws_calls
