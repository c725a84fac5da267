"""The wide heads' Gluon backward (kernels/gluon/attn_bwd_dsplit.py) on a Hopper GPU (``pytest -m gpu``).

Its column units differ per (width, dv) pair: 128 + 128 + 128 per warpgroup at d = dv = 256, 128 + 64 + 64
against 64 + 64 + 128 at d 192 / dv 128, and 128 + 64 + 128 at d 256 / dv 128; d below the width (160,
224) leaves padding columns that must neither enter a product nor be stored. Every case runs its explicit
route (`routes.dsplit_backward_route`: the default at width 256; at 192 the default is attn_bwd_keys.py,
and this kernel an A/B alternative), asserts it and checks the gradients against the oracle; the options
and the varlen layout are also covered by test_gluon_features_gpu.py, whose d 193..256 cases take it.
"""

from __future__ import annotations

import pytest
import torch
from gluon_helpers import (
    assert_reproducible,
    assert_varlen_reproducible,
    check_features,
    check_varlen,
    options_for,
    qkv_dv,
)
from gluon_helpers import qkv as _qkv
from gluon_helpers import vary_routes as _vary_routes

from flashattn import flash_attn_func
from flashattn.backends.triton import attention, routes

pytestmark = pytest.mark.gpu


@pytest.fixture
def dsplit_route(monkeypatch):
    monkeypatch.setattr(attention, "_backward_cache", {})
    monkeypatch.setattr(routes, "backward_route", routes.dsplit_backward_route)

# (d, dv, the kernel's column width)
PAIRS = [(256, 256, 256), (192, 128, 192), (160, 128, 192), (256, 128, 256), (224, 256, 256)]


def _check(fwd_calls, bwd_calls, width, q, k, v, **options):
    check_features(fwd_calls, bwd_calls, q, k, v, **options)
    assert all(r.d_qk == width and not r.wide_keys for r in bwd_calls.routes)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (63, 65), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("d, dv, width", PAIRS, ids=str)
def test_wide_backward_seqlens(dsplit_route, ws_calls, ws_bwd_calls, d, dv, width, sq, sk, causal):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, width, *qkv_dv(2, sq, sk, 4, 2, d, dv), causal=causal)


@pytest.mark.parametrize("features", ["window", "swa+softcap", "alibi", "alibi_bh+sink", "softcap+alibi_bh",
                                      "window+softcap+alibi+sink"])
@pytest.mark.parametrize("d, dv, width", [(256, 256, 256), (192, 128, 192)], ids=str)
@pytest.mark.parametrize("sq, sk", [(113, 1023), (1023, 113), (1023, 1023)])
def test_wide_backward_options(dsplit_route, ws_calls, ws_bwd_calls, d, dv, width, features, sq, sk):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, width, *qkv_dv(2, sq, sk, 4, 2, d, dv), **options_for(2, 4, features))


@pytest.mark.parametrize("window", [(63, 0), (64, 0), (0, 63), (31, 32), (64, 64)], ids=str)
def test_wide_backward_window_edges_at_step_boundaries(dsplit_route, ws_calls, ws_bwd_calls, window):
    # 64-key tiles, 64-row steps and 32-row halves: edges on and beside each
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, 256, *qkv_dv(1, 700, 700, 4, 2, 256, 256), window_size=window)


@pytest.mark.parametrize("h, hk, split", [(8, 1, 4), (8, 2, 2), (8, 2, 1)], ids=["mqa-4", "gqa4-2", "gqa4-1"])
@pytest.mark.parametrize("d, dv, width", [(256, 256, 256), (192, 128, 192), (160, 128, 192)], ids=str)
def test_wide_backward_gqa_and_group_split(dsplit_route, ws_calls, ws_bwd_calls, monkeypatch, h, hk, split, d,
                                           dv, width):
    # the parts add their columns of dK and dV into float32 buffers shaped like k and v
    _vary_routes(monkeypatch, backward=dict(group_split=split))
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, width, *qkv_dv(2, 300, 1100, h, hk, d, dv), causal=True)
    _check(ws_calls, ws_bwd_calls, width, *qkv_dv(1, 1023, 113, h, hk, d, dv))


@pytest.mark.parametrize("d, dv", [(256, 256), (192, 128), (160, 128)], ids=str)
@pytest.mark.parametrize("features", ["causal", "swa+softcap+sink"])
def test_wide_backward_varlen(dsplit_route, ws_calls, ws_bwd_calls, d, dv, features):
    # empty documents, one-row ones, a sequence ending inside a key tile (its last keys by masked stores)
    torch.manual_seed(0)
    options = dict(causal=True) if features == "causal" else options_for(1, 4, features)
    check_varlen(ws_calls, ws_bwd_calls, [0, 65, 1, 300, 129, 0], [7, 65, 2, 200, 300, 0], 4, 2, d, dv=dv,
                 **options)
    assert all(r.d_qk and not r.wide_keys for r in ws_bwd_calls.routes)


def test_wide_backward_fp16_long(dsplit_route, ws_calls, ws_bwd_calls):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, 256, *qkv_dv(1, 4097, 4097, 4, 1, 256, 256, torch.float16), causal=True)


DSPLIT_DETERMINISTIC = {"causal": dict(causal=True), "full": {}, "window": dict(window_size=(100, 37)),
                        "left": dict(window_size=(300, -1))}


@pytest.mark.parametrize("sq, sk", [(1023, 1023), (113, 1023), (1023, 113), (1537, 2049)], ids=str)
@pytest.mark.parametrize("d, dv, width", [(256, 256, 256), (224, 128, 256), (192, 128, 192)], ids=str)
@pytest.mark.parametrize("name", list(DSPLIT_DETERMINISTIC))
def test_wide_backward_deterministic(dsplit_route, ws_calls, ws_bwd_calls, name, d, dv, width, sq, sk):
    # the dQ writer adds each step's units in two rounds (d 192: the second warpgroup's second unit alone
    # in round 1), in the fixed order across programs: the oracle's tolerance, and bitwise the same
    # gradients call after call (GQA: the group's heads in one program)
    torch.manual_seed(0)
    options = DSPLIT_DETERMINISTIC[name]
    q, k, v = qkv_dv(2, sq, sk, 8, 2, d, dv)
    _check(ws_calls, ws_bwd_calls, width, q, k, v, attn=lambda q, k, v: flash_attn_func(
        q, k, v, deterministic=True, return_attn_probs=True, **options)[:2], **options)
    assert all(r.deterministic for r in ws_bwd_calls.routes)
    dout = torch.randn(2, sq, 8, dv, device="cuda", dtype=q.dtype)
    assert_reproducible(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                        dout)


def test_wide_backward_deterministic_varlen(ws_calls, ws_bwd_calls, monkeypatch):

    monkeypatch.setattr(attention, "_backward_cache", {})  # the default route: d 256 takes this kernel
    lens = [0, 77, 1, 700, 0, 129, 300]
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 2, 256, gluon_backward=True, causal=True,
                 deterministic=True)
    assert all(r.d_qk == 256 and r.deterministic for r in ws_bwd_calls.routes)
    assert_varlen_reproducible(lens, 256, 256)


def test_wide_backward_deterministic_with_a_sink_keeps_triton(ws_bwd_calls):
    q, k, v = _qkv(1, 512, 512, 2, 2, 256)
    sink = torch.zeros(2, device="cuda", requires_grad=True)
    flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink).sum().backward()
    assert not ws_bwd_calls
