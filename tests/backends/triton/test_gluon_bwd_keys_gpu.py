"""The 128-key wide-head Gluon backward (kernels/gluon/attn_bwd_keys.py) on a Hopper GPU (``pytest -m gpu``).

d_qk 129..192 beside dv 33..128, the default route of these head dims: each warpgroup owns 64 of a program's
128 keys and every column of their dK (a 128- and a 64-column accumulator) and dV, over 32-row steps, and
computes its dQ units transposed. Each case asserts that the route ran and checks the forward, the LSE and
the gradients against the oracle; odd lengths put sequence ends inside the 32-row steps and both key halves.
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
    vary_routes,
)

from flashattn.backends.triton import attention

pytestmark = pytest.mark.gpu

PAIRS = [(192, 128), (160, 128), (192, 64), (136, 96)]


@pytest.fixture
def keys_route(monkeypatch):
    # the default routes, no signature cached by an earlier test's forced route
    monkeypatch.setattr(attention, "_backward_cache", {})


def _check(fwd_calls, bwd_calls, q, k, v, **options):
    check_features(fwd_calls, bwd_calls, q, k, v, **options)
    assert all(r.wide_keys and r.tiles.block_m == 32 for r in bwd_calls.routes)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (63, 65), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("d, dv", PAIRS, ids=str)
def test_keys_backward_seqlens(keys_route, ws_calls, ws_bwd_calls, d, dv, sq, sk, causal):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 4, 2, d, dv), causal=causal)


@pytest.mark.parametrize("features", ["window", "swa+softcap", "alibi_bh+sink", "window+softcap+alibi+sink"])
@pytest.mark.parametrize("sq, sk", [(113, 1023), (1023, 113), (1023, 1023)])
def test_keys_backward_options(keys_route, ws_calls, ws_bwd_calls, features, sq, sk):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 4, 2, 192, 128), **options_for(2, 4, features))


@pytest.mark.parametrize("window", [(31, 0), (32, 0), (0, 63), (64, 64), (127, 0)], ids=str)
def test_keys_backward_window_edges(keys_route, ws_calls, ws_bwd_calls, window):
    # 32-row steps, 64-key halves, 128-key tiles: edges on and beside each
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(1, 700, 700, 4, 2, 192, 128), window_size=window)


@pytest.mark.parametrize("h, hk, split", [(8, 1, 4), (8, 2, 2), (8, 2, 1)], ids=["mqa-4", "gqa4-2", "gqa4-1"])
def test_keys_backward_gqa_and_group_split(keys_route, ws_calls, ws_bwd_calls, monkeypatch, h, hk, split):
    vary_routes(monkeypatch, backward=dict(group_split=split))
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, 300, 1100, h, hk, 192, 128), causal=True)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(1, 1023, 113, h, hk, 160, 128))


@pytest.mark.parametrize("d, dv", [(192, 128), (160, 104)], ids=str)
@pytest.mark.parametrize("features", ["causal", "swa+softcap+sink"])
def test_keys_backward_varlen(keys_route, ws_calls, ws_bwd_calls, d, dv, features):
    # empty documents, one-row ones, sequences ending inside a 64-key half (their last keys by masked stores)
    torch.manual_seed(0)
    options = dict(causal=True) if features == "causal" else options_for(1, 4, features)
    check_varlen(ws_calls, ws_bwd_calls, [0, 65, 1, 300, 129, 0], [7, 65, 2, 200, 300, 0], 4, 2, d, dv=dv,
                 gluon_backward=True, **options)
    assert all(r.wide_keys for r in ws_bwd_calls.routes)


def test_keys_backward_fp16_long(keys_route, ws_calls, ws_bwd_calls):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(1, 4097, 4097, 4, 1, 192, 128, torch.float16), causal=True)



def test_keys_backward_dv_widths_in_turn(keys_route, ws_calls, ws_bwd_calls):
    # the kernel takes dv's tile width from its descriptors alone: calls alike in every other argument's
    # specialisation must not share a launch plan (launch._spec keys descriptors on their block shapes)
    for dv in (64, 128, 64):
        torch.manual_seed(0)
        _check(ws_calls, ws_bwd_calls, *qkv_dv(2, 113, 1023, 4, 2, 192, dv), causal=True)


# the fixed-order variant (deterministic=True, the default route there): the band's right edge reversing the
# key tiles' order (causal, a two-sided window), none (full, a left edge), and GQA's groups on one program
KEYS_DETERMINISTIC = {"causal": dict(causal=True), "full": {}, "window": dict(window_size=(100, 37)),
                      "left": dict(window_size=(300, -1))}


@pytest.mark.parametrize("sq, sk", [(1023, 1023), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("d, dv", [(192, 128), (160, 104)], ids=str)
@pytest.mark.parametrize("name", list(KEYS_DETERMINISTIC))
def test_keys_backward_deterministic(keys_route, ws_calls, ws_bwd_calls, name, d, dv, sq, sk):
    from flashattn import flash_attn_func

    torch.manual_seed(0)
    options = KEYS_DETERMINISTIC[name]
    q, k, v = qkv_dv(2, sq, sk, 8, 2, d, dv)
    _check(ws_calls, ws_bwd_calls, q, k, v, attn=lambda q, k, v: flash_attn_func(
        q, k, v, deterministic=True, return_attn_probs=True, **options)[:2], **options)
    assert all(r.deterministic for r in ws_bwd_calls.routes)
    # bitwise the same gradients, call after call
    dout = torch.randn(2, sq, 8, dv, device="cuda", dtype=q.dtype)
    assert_reproducible(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                        dout)


def test_keys_backward_deterministic_varlen(keys_route, ws_calls, ws_bwd_calls):

    lens = [0, 77, 1, 700, 0, 129, 300]
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 2, 192, dv=128, gluon_backward=True, causal=True,
                 deterministic=True)
    assert all(r.wide_keys and r.deterministic for r in ws_bwd_calls.routes)
    assert_varlen_reproducible(lens, 192, 128)
