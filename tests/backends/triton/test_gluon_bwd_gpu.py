"""The warp-specialised Gluon backward (kernels/gluon/attn_bwd.py) on a Hopper GPU (``pytest -m gpu``).

Every case asserts that the call really took the kernel (the `ws_bwd_calls` spy, conftest.py). The route's
options (the deferred dQ, the GQA group split, the deterministic variant) are each run against the oracle
through route variants; gradients by the tolerance rule of tests/utils.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gluon_helpers import VARLEN_K, VARLEN_Q, assert_reproducible, assert_varlen_reproducible, check_varlen
from gluon_helpers import qkv as _qkv
from gluon_helpers import vary_routes as _vary_routes
from test_interface import check_against_oracle
from utils import use_tiles

from flashattn import flash_attn_func
from flashattn.backends.triton import routes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (1300, 100), (2049, 1537)])
def test_backward_seqlens(ws_bwd_calls, sq, sk, d, causal):
    check_against_oracle(*_qkv(2, sq, sk, 4, 4, d), causal=causal)
    assert ws_bwd_calls, "the warp-specialised backward did not run"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk", [(8, 2), (8, 1)], ids=["gqa4", "mqa"])
def test_backward_gqa(ws_bwd_calls, h, hk, causal):
    check_against_oracle(*_qkv(2, 700, 1100, h, hk, 128), causal=causal)
    assert ws_bwd_calls


@pytest.mark.parametrize("defer", [True, False], ids=["deferred-dq", "step-dq"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk, h, hk",
                         [(17, 17, 4, 2), (1023, 113, 4, 4), (300, 1100, 4, 2), (2049, 1537, 8, 2)])
def test_backward_d64_dq_orders(ws_bwd_calls, monkeypatch, defer, sq, sk, h, hk, causal):
    # d = 64 with 64-row steps computes each step's dQ one step late; both orders against the oracle
    use_tiles(monkeypatch, "bwd_ws=64,128,4,3")
    _vary_routes(monkeypatch, backward=dict(defer_dq=defer))
    check_against_oracle(*_qkv(2, sq, sk, h, hk, 64), causal=causal)
    assert ws_bwd_calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h, hk, split, d", [(8, 1, 8, 128), (8, 1, 4, 64), (8, 2, 2, 128), (12, 4, 3, 64)],
                         ids=["mqa-8", "mqa-4-d64", "gqa4-2", "gqa3-3-d64"])
def test_backward_group_split(ws_bwd_calls, monkeypatch, h, hk, split, d, causal):
    # the group's parts add dK and dV into float32 buffers: every part's share lands once, at odd lengths
    _vary_routes(monkeypatch, backward=dict(group_split=split))
    check_against_oracle(*_qkv(2, 300, 1100, h, hk, d), causal=causal)
    check_against_oracle(*_qkv(1, 1023, 113, h, hk, d), causal=causal)
    assert ws_bwd_calls


def test_backward_group_split_varlen(ws_calls, ws_bwd_calls, monkeypatch):
    torch.manual_seed(0)
    _vary_routes(monkeypatch, backward=dict(group_split=4))
    check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, 8, 2, 128, causal=True)


def test_backward_group_split_must_divide_the_group(ws_bwd_calls, monkeypatch):
    from flashattn.errors import FlashAttnError

    _vary_routes(monkeypatch, backward=dict(group_split=3))
    q, k, v = _qkv(1, 64, 64, 8, 2, 64)
    with pytest.raises(FlashAttnError, match="group_split is 3; it must divide the GQA group"):
        flash_attn_func(q, k, v).sum().backward()


@pytest.mark.parametrize("d", [64, 128])
def test_backward_fp16_and_packed(ws_bwd_calls, d):
    check_against_oracle(*_qkv(2, 1000, 1200, 4, 2, d, torch.float16), causal=True)
    qkv = torch.randn(2, 1777, 3, 8, d, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    check_against_oracle(*qkv.unbind(2), causal=False, wrt=(qkv,))
    assert len(ws_bwd_calls) == 2


# deterministic=True: the fixed-order dQ variant of the Gluon backward. Both orders (a right edge: the last
# key tile adds first; none: the first), GQA, sq != sk both ways, 64-row (deferred dQ) and 128-row steps
DETERMINISTIC = {"causal": dict(causal=True), "full": {}, "swa": dict(causal=True, window_size=(255, -1)),
                 "window": dict(window_size=(100, 37)), "left": dict(window_size=(300, -1)),
                 "right": dict(window_size=(-1, 64))}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1023, 1023), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_backward_deterministic(ws_bwd_calls, name, sq, sk, d):
    # the dQ writer keeping its order per 128 query rows over 64-row steps (per step over 128-row ones): a
    # program's first step in the middle of a counter tile, odd step counts, both orders; against the
    # oracle, and bitwise the same call after call
    torch.manual_seed(0)
    options = DETERMINISTIC[name]
    q, k, v = _qkv(2, sq, sk, 4, 2, d)
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    check_against_oracle(q, k, v, causal=causal, window_size=window, attn=lambda q, k, v: flash_attn_func(
        q, k, v, causal=causal, window_size=window, deterministic=True, return_attn_probs=True)[:2])
    assert ws_bwd_calls and all(r.deterministic and r.dq_order_rows == (128 if r.tiles.block_m == 64 else 0)
                                for r in ws_bwd_calls.routes)
    assert any(r.dq_order_rows for r in ws_bwd_calls.routes) == (d == 128 or name != "full")
    dout = torch.randn(2, sq, 4, d, device="cuda", dtype=q.dtype)
    assert_reproducible(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                        dout, calls=4)


@pytest.mark.parametrize("d, dv", [(96, 96), (80, 80), (40, 40), (128, 96), (72, 64)], ids=str)
@pytest.mark.parametrize("name", ["causal", "full", "window"])
def test_backward_deterministic_padded_head_dims(ws_bwd_calls, monkeypatch, name, d, dv):
    # the fixed-order variant at head dims below its tiles' widths, on its explicit route (the default sends
    # these calls to the Triton backward until this runs): against the oracle, and bitwise the same twice
    from gluon_helpers import qkv_dv

    from flashattn.backends.triton import attention

    monkeypatch.setattr(attention, "_backward_cache", {})
    monkeypatch.setattr(routes, "backward_route", routes.gluon_backward_route)
    torch.manual_seed(0)
    options = DETERMINISTIC[name]
    q, k, v = qkv_dv(2, 1023, 700, 4, 2, d, dv)
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    check_against_oracle(q, k, v, causal=causal, window_size=window, attn=lambda q, k, v: flash_attn_func(
        q, k, v, causal=causal, window_size=window, deterministic=True, return_attn_probs=True)[:2])
    assert ws_bwd_calls and all(r.deterministic for r in ws_bwd_calls.routes)
    dout = torch.randn(2, 1023, 4, dv, device="cuda", dtype=q.dtype)
    assert_reproducible(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                        dout, calls=2)


@pytest.mark.parametrize("d, dv, h, hk, split", [(128, 128, 8, 1, 4), (64, 64, 8, 2, 2), (192, 128, 8, 1, 4),
                                                  (256, 256, 8, 2, 2)], ids=str)
@pytest.mark.parametrize("name", ["causal", "full", "window"])
def test_backward_deterministic_group_split(ws_bwd_calls, monkeypatch, name, d, dv, h, hk, split):
    # the fixed-order variants of the three kernels with the GQA group split (and attn_bwd.py's dQ order per
    # 128 rows where it steps 64), each split count forced: each part adds dK and dV into kv heads of its
    # own, summed after in a fixed order; against the oracle, and bitwise the same call after call
    from gluon_helpers import qkv_dv

    from flashattn.backends.triton import attention

    monkeypatch.setattr(attention, "_backward_cache", {})
    real = routes.backward_route
    monkeypatch.setattr(routes, "backward_route", lambda spec: dataclasses.replace(
        real(dataclasses.replace(spec, deterministic=True)), group_split=split))
    torch.manual_seed(0)
    options = DETERMINISTIC[name]
    q, k, v = qkv_dv(2, 1023, 700, h, hk, d, dv)
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    check_against_oracle(q, k, v, causal=causal, window_size=window, attn=lambda q, k, v: flash_attn_func(
        q, k, v, causal=causal, window_size=window, deterministic=True, return_attn_probs=True)[:2])
    assert ws_bwd_calls and all(r.deterministic and r.group_split == split for r in ws_bwd_calls.routes)
    dout = torch.randn(2, 1023, h, dv, device="cuda", dtype=q.dtype)
    assert_reproducible(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                        dout, calls=3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_deterministic_varlen(ws_calls, ws_bwd_calls, causal):
    # empty sequences, one-row ones, several key tiles; bitwise the same twice
    lens = [0, 77, 1, 700, 0, 129, 300]
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 2, 128, causal=causal, deterministic=True)
    assert all(r.deterministic for r in ws_bwd_calls.routes)
    assert_varlen_reproducible(lens, 128, 128, causal=causal)


@pytest.mark.parametrize("d, h, hk", [(128, 8, 1), (64, 16, 4)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_deterministic_varlen_group_split(ws_calls, ws_bwd_calls, causal, d, h, hk):
    # packed documents of a GQA group the default deterministic route splits (each part's dK and dV into kv
    # heads of its own over the packed keys, summed after), with empty and one-row sequences
    lens = [0, 77, 1, 700, 0, 129, 300]
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, h, hk, d, causal=causal, deterministic=True)
    assert all(r.deterministic and r.group_split > 1 for r in ws_bwd_calls.routes)
    assert_varlen_reproducible(lens, d, d, causal=causal, h=h, hk=hk)


def test_backward_deterministic_with_a_sink_keeps_triton(ws_bwd_calls):
    q, k, v = _qkv(1, 512, 512, 2, 2, 128)
    sink = torch.randn(2, device="cuda", requires_grad=True)
    flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink).sum().backward()
    assert not ws_bwd_calls


def test_backward_on_the_triton_route(ws_bwd_calls, monkeypatch):
    _vary_routes(monkeypatch)
    monkeypatch.setattr(routes, "backward_route", routes.triton_backward_route)
    check_against_oracle(*_qkv(2, 300, 300, 4, 4, 128), causal=True)
    assert not ws_bwd_calls


def test_backward_key_tail_with_very_negative_lse(ws_bwd_calls):
    # every score near -140: lse ~ -134, so an unmasked key past seqlen_k (a zero row) would give
    # P = exp2(0 - lse * log2 e) = inf and NaN in dQ; sk = 1000 leaves such rows in the last key tile
    u = torch.ones(128, device="cuda") / 128**0.5
    noise = 0.01 * torch.randn(2, 1000, 4, 128, device="cuda")
    q = (-40 * u + noise[:, :700]).to(torch.bfloat16).requires_grad_(True)
    k = (40 * u + noise).to(torch.bfloat16).requires_grad_(True)
    v = torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_func(q, k, v)
    out.backward(torch.randn_like(out))
    assert ws_bwd_calls
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("hk", [4, 1], ids=["kv-groups", "mqa-parts"])
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_backward_by_kv_head_groups(ws_calls, ws_bwd_calls, monkeypatch, varlen, hk):
    # past routes.DQ_BUFFER_CAP a backward runs one group of heads at a time (head_groups.py), each on the
    # Gluon kernel with a buffer of its share: the caps lowered so that these calls split into four groups,
    # of a KV head and its two query heads, or (MQA) of two of the one KV head's query heads
    from flashattn.backends.triton import attention

    torch.manual_seed(0)
    h = 8
    sink = torch.randn(h, device="cuda", requires_grad=True)
    options = dict(causal=True, window_size=(300, -1), learnable_sink=sink,
                   alibi_slopes=torch.rand(h, device="cuda"))
    monkeypatch.setattr(attention, "_backward_cache", {})
    if varlen:
        lens = torch.tensor(VARLEN_Q, dtype=torch.int32)
        nbytes = int(lens.sum()) * h * 128 * 4
        monkeypatch.setattr(routes, "DQ_BUFFER_CAP", nbytes // 4)
        monkeypatch.setattr(routes, "DQ_GROUP_BYTES", nbytes // 4)
        check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, h, hk, 128, gluon_backward=True, **options)
    else:
        q, k, v = _qkv(2, 1023, 1100, h, hk, 128)
        monkeypatch.setattr(routes, "DQ_BUFFER_CAP", q.numel() * 4 // 4)
        monkeypatch.setattr(routes, "DQ_GROUP_BYTES", q.numel() * 4 // 4)
        check_against_oracle(q, k, v, wrt=(q, k, v, sink), **options)
    # one Gluon backward per group, each over its two query heads
    assert len(ws_bwd_calls) == 4 and all(shape[-2] == 2 for shape in ws_bwd_calls)
