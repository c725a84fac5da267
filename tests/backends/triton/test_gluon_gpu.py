"""The warp-specialised Gluon kernels (kernels/gluon/) on a Hopper GPU (``pytest -m gpu``).

Every case asserts that the call really took the kernel (a spy on backends/triton/gluon.py's launchers), so
a change in the routes cannot turn these into tests of the Triton kernels. The routes' options (the grid,
the half-diagonal step, the deferred release and dQ, the consumer count) are each run against the oracle
through route variants. Same tolerance rule as everywhere (tests/utils.py), forward and LSE and gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_interface import check_against_oracle
from utils import assert_close_to_ref, use_tiles

from flashattn import config as flashattn_config
from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.backends.triton import attention, gluon, routes
from flashattn.reference import attention_ref

pytestmark = pytest.mark.gpu


class _Calls(list):
    """The q shape of every call to a Gluon launcher; `routes`: the route of each."""

    def __init__(self):
        super().__init__()
        self.routes = []


def _spy(monkeypatch, launcher: str) -> list:
    """On the Triton backend, the q shape of every call to gluon.<launcher> (a Gluon kernel ran)."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    calls = _Calls()
    real = getattr(gluon, launcher)

    def spy(*args, **kwargs):
        calls.append(args[2].shape)
        calls.routes.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon, launcher, spy)
    return calls


def _vary_routes(monkeypatch, forward=None, backward=None) -> None:
    """Every call of the test on its default routes with some fields replaced (forward / backward: dicts),
    the launchers' signature caches emptied so that no default-route entry serves it."""
    monkeypatch.setattr(attention, "_forward_cache", {})
    monkeypatch.setattr(attention, "_backward_cache", {})
    for name, fields in (("forward_route", forward), ("backward_route", backward)):
        if fields:
            real = getattr(routes, name)
            monkeypatch.setattr(routes, name, lambda spec, real=real, fields=fields: dataclasses.replace(
                real(spec), **fields))


@pytest.fixture
def ws_calls(monkeypatch):
    return _spy(monkeypatch, "forward")


def _qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(True)

    return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)


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
    flash_attn_func(*_qkv(1, 256, 256, 2, 2, 96), softcap=5.0)
    flash_attn_func(*_qkv(1, 256, 256, 2, 2, 128, torch.float32), window_size=(-1, 8))
    assert not ws_calls


# ---------------------------------------------------------- the Gluon backward


@pytest.fixture
def ws_bwd_calls(monkeypatch):
    return _spy(monkeypatch, "backward")


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
    _check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, 8, 2, 128, causal=True)


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


def _grads(q, k, v, dout, **options):
    out = flash_attn_func(q, k, v, **options)
    return torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1023, 1023), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_backward_deterministic(ws_bwd_calls, name, sq, sk, d):
    torch.manual_seed(0)
    options = DETERMINISTIC[name]
    q, k, v = _qkv(2, sq, sk, 4, 2, d)
    causal = options.get("causal", False)
    window = options.get("window_size", (-1, -1))
    check_against_oracle(q, k, v, causal=causal, window_size=window, attn=lambda q, k, v: flash_attn_func(
        q, k, v, causal=causal, window_size=window, deterministic=True, return_attn_probs=True)[:2])
    assert ws_bwd_calls and all(r.deterministic for r in ws_bwd_calls.routes)
    # bitwise the same gradients, call after call
    dout = torch.randn(2, sq, 4, d, device="cuda", dtype=q.dtype)
    first = _grads(q, k, v, dout, deterministic=True, **options)
    for _ in range(3):
        again = _grads(q, k, v, dout, deterministic=True, **options)
        for name_, a, b in zip("qkv", first, again, strict=True):
            assert torch.equal(a, b), f"d{name_} differs between two deterministic calls"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_deterministic_varlen(ws_calls, ws_bwd_calls, causal):
    # empty sequences, one-row ones, several key tiles; bitwise the same twice
    lens = [0, 77, 1, 700, 0, 129, 300]
    _check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 2, 128, causal=causal, deterministic=True)
    assert all(r.deterministic for r in ws_bwd_calls.routes)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (4, 2, 2))
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal, deterministic=True)
    dout = torch.randn_like(out)
    runs = [torch.autograd.grad(flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                                       deterministic=True), (q, k, v), dout)
            for _ in range(3)]
    for a, b in zip(runs[0], runs[1] + runs[2], strict=False):
        assert torch.equal(a, b)


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


# ---------------------------------------------------------- the training features on the Gluon kernels
# Windows (alone and with causal), softcap, ALiBi and learnable sinks are compile-time variants of both Gluon
# kernels. Each case asserts that both launchers ran, and checks the forward, the LSE and every gradient (the
# sink's included) against the oracle.


def _options(b, h, features: str) -> dict:
    """flash_attn_func's options for features, '+'-separated: window (left and right edges), swa (causal with
    a left edge), softcap, alibi ((h,) slopes), alibi_bh ((b, h) slopes), sink."""
    table = {
        "window": dict(window_size=(100, 37)),
        "swa": dict(causal=True, window_size=(255, -1)),
        "softcap": dict(softcap=20.0),
        "alibi": dict(alibi_slopes=torch.rand(h, device="cuda")),
        "alibi_bh": dict(alibi_slopes=torch.rand(b, h, device="cuda")),
        "sink": dict(learnable_sink=torch.randn(h, device="cuda").requires_grad_(True)),
    }
    options = {}
    for name in features.split("+"):
        options.update(table[name])
    return options


def _check_features(fwd_calls, bwd_calls, q, k, v, grads=True, gluon_backward=True, **options):
    """check_against_oracle with the sink's gradient checked too; the Gluon forward must have run, and the
    Gluon backward where gluon_backward (else the Triton one, as at d = 256)."""
    causal = options.pop("causal", False)
    sink = options.get("learnable_sink")
    wrt = None if sink is None else (q, k, v, sink)
    result = check_against_oracle(q, k, v, causal=causal, grads=grads, wrt=wrt, **options)
    assert fwd_calls, "the Gluon forward did not run"
    if grads:
        assert bool(bwd_calls) is gluon_backward, f"the Gluon backward ran: {bool(bwd_calls)}"
    return result


FEATURES = ["window", "swa", "softcap", "alibi", "alibi_bh", "sink"]
# every pair of the four options (a window stands for the band)
PAIRS = ["swa+softcap", "window+alibi", "swa+sink", "softcap+alibi_bh", "softcap+sink", "alibi+sink",
         "window+softcap+alibi+sink"]
FEATURE_SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (113, 1023), (1023, 113), (1, 1023),
                   (2049, 1537)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", FEATURE_SEQLENS)
@pytest.mark.parametrize("features", FEATURES)
def test_feature_seqlens(ws_calls, ws_bwd_calls, features, sq, sk, d):
    torch.manual_seed(0)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, d), **_options(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(113, 1023), (1023, 113), (1023, 1023)])
@pytest.mark.parametrize("features", PAIRS)
def test_feature_pairs(ws_calls, ws_bwd_calls, features, sq, sk, d):
    torch.manual_seed(0)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, d), **_options(2, 4, features))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("features, d", [("swa+sink", 64), ("sink", 128), ("alibi+sink", 64)])
def test_sink_gradient_over_draws(ws_calls, ws_bwd_calls, features, d, seed):
    # the sink's gradient sums P_sink · rowsum(P ∘ dP) over every row: taken from the rounded output's D it
    # passed plain PyTorch's error several-fold on some draws (swa+sink 113 x 1023 at d = 64: 5x); the
    # kernel sums it from its float32 P and dP
    torch.manual_seed(seed)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, 113, 1023, 4, 2, d), **_options(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["swa", "window", "softcap+alibi", "swa+sink"])
def test_features_at_4097(ws_calls, ws_bwd_calls, features, d):
    # past 4K at d = 64 the forward takes three consumer warpgroups (a band wider than 4K, or none)
    torch.manual_seed(0)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(1, 4097, 4097, 2, 1, d), **_options(1, 2, features))


# windows whose edges fall on and beside tile boundaries (64-row warpgroups, 128-key tiles, 192-row tiles),
# with the diagonal shifted both ways by seqlen_q != seqlen_k
WINDOW_EDGES = [(127, 0), (128, 0), (63, 64), (64, 64), (191, 1), (192, 0), (0, 0), (0, 127), (-1, 128),
                (128, -1), (1, 1)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1024, 1024), (1024, 1088), (1088, 1024), (1152, 1152)])
@pytest.mark.parametrize("window", WINDOW_EDGES, ids=str)
def test_window_edges_at_tile_boundaries(ws_calls, ws_bwd_calls, window, sq, sk, d):
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 4, d), window_size=window)


@pytest.mark.parametrize("tiles", ["fwd_ws=192,128,4,3", "fwd_ws=128,128,4,3"], ids=["three", "two"])
@pytest.mark.parametrize("window", [(255, 0), (130, 70), (-1, 65), (300, -1)], ids=str)
def test_window_d64_consumer_counts(ws_calls, ws_bwd_calls, monkeypatch, tiles, window):
    # three consumer warpgroups run serial steps with their own half-diagonal step: both counts per band
    use_tiles(monkeypatch, tiles)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, 1500, 1400, 4, 2, 64), window_size=window)


@pytest.mark.parametrize("order", ["default", "full-diagonal", "tile-end-release", "one-program-per-tile"])
@pytest.mark.parametrize("d", [64, 128])
def test_window_forward_route_options(ws_calls, monkeypatch, order, d):
    # the half-diagonal step under a right edge other than the diagonal, the deferred Q release and the
    # grid, each off alone; more tiles than SMs so that programs take several (some without keys: sq > sk)
    fields = {"default": {}, "full-diagonal": dict(half_diag=False),
              "tile-end-release": dict(defer_release=False), "one-program-per-tile": dict(persistent=False)}
    _vary_routes(monkeypatch, forward=fields[order])
    for window, sq, sk in (((200, 90), 2100, 1800), ((-1, 7), 1800, 2100), ((64, 0), 2100, 300)):
        check_against_oracle(*_qkv(3, sq, sk, 24, 8, d), window_size=window, softcap=15.0, grads=False)
    assert len(ws_calls) == 3


@pytest.mark.parametrize("defer", [True, False], ids=["deferred-dq", "step-dq"])
@pytest.mark.parametrize("features", ["swa", "window+softcap", "alibi_bh+sink"])
def test_d64_backward_dq_orders_with_features(ws_calls, ws_bwd_calls, monkeypatch, defer, features):
    _vary_routes(monkeypatch, backward=dict(defer_dq=defer))
    torch.manual_seed(0)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, 1100, 1300, 4, 2, 64), **_options(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["window", "swa", "softcap", "sink"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_features_dtypes_and_gqa(ws_calls, ws_bwd_calls, dtype, features, d):
    torch.manual_seed(0)
    for h, hk in ((8, 1), (12, 4)):
        _check_features(ws_calls, ws_bwd_calls, *_qkv(2, 700, 1100, h, hk, d, dtype),
                        **_options(2, h, features))


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("window, sq, sk", [((20, 10), 300, 100), ((-1, 0), 1400, 3), ((50, 0), 700, 190),
                                            ((5, 5), 1000, 64)], ids=str)
def test_rows_without_keys_under_a_band(ws_calls, ws_bwd_calls, window, sq, sk, sink):
    # the first sq - sk - right rows end before key 0: out 0, dq 0, lse +inf (the sink's value with one),
    # never NaN; query tiles with no key at all, and key tiles no query sees (dk = dv = 0)
    n = sq - sk - window[1]
    options = _options(1, 2, "sink") if sink else {}
    floor = "rounding" if sk <= 3 else None  # see tests/test_interface.py::test_fully_masked_rows
    out, lse, grads = _check_features(ws_calls, ws_bwd_calls, *_qkv(1, sq, sk, 2, 2, 128), window_size=window,
                                      grad_floor=floor, **options)
    dq = grads[0]
    assert (out[:, :n] == 0).all() and (dq[:, :n] == 0).all()
    if sink:
        torch.testing.assert_close(lse[0, :, :n], options["learnable_sink"].detach()[:, None].expand(2, n))
    else:
        assert torch.isposinf(lse[:, :, :n]).all()
    assert torch.isfinite(lse[:, :, n:]).all() and not any(torch.isnan(g).any() for g in grads)


@pytest.mark.parametrize("window", [(50, 0), (100, 30)], ids=str)
def test_keys_no_query_sees(ws_calls, ws_bwd_calls, window):
    # sq < sk under a left edge: row i sees keys from i + sk - sq - left on, so the first sk - sq - left keys
    # (whole key tiles of the backward's programs) get dk = dv = 0
    sq, sk = 100, 700
    _, _, (_, dk, dv) = _check_features(ws_calls, ws_bwd_calls, *_qkv(1, sq, sk, 2, 2, 128),
                                        window_size=window)
    n = sk - sq - window[0]
    assert (dk[:, :n] == 0).all() and (dv[:, :n] == 0).all()
    assert dk[:, n:].abs().sum() > 0


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_softcap_saturated_and_loose(ws_calls, ws_bwd_calls, softcap):
    # large logits: a small cap saturates tanh (its derivative near 0), a large one barely bends them
    q, k, v = _qkv(2, 600, 900, 4, 2, 128)
    with torch.no_grad():
        q.mul_(8.0)
    _check_features(ws_calls, ws_bwd_calls, q, k, v, softcap=softcap, causal=True)


def test_extreme_sinks(ws_calls, ws_bwd_calls):
    # a sink far above every score takes nearly all the mass (out ~ 0, lse ~ sink), one far below none
    sink = torch.tensor([30.0, -30.0, 0.0, 5.0], device="cuda", requires_grad=True)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, 500, 700, 4, 2, 64), learnable_sink=sink,
                    window_size=(128, 0))


# ---------------------------------------------------------- the Gluon kernels on packed sequences (varlen)
# Each case checks the forward, LSE and gradients sequence by sequence against the oracle; the backward is
# the Gluon one at d = dv = 64 or 128 (asserted), else the Triton one, reading the Gluon forward's LSE.


def _check_varlen(fwd_calls, bwd_calls, lens_q, lens_k, h, hk, d, dtype=torch.bfloat16, dv=None, **options):
    gluon_backward = d in routes.GLUON_BWD_HEADDIMS and (dv or d) == d
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                 device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hk, dim, device="cuda", dtype=dtype, requires_grad=True)
            for dim in (d, dv or d))
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         return_attn_probs=True, **options)
    assert fwd_calls, "the Gluon forward did not run"
    assert lse.shape == (h, sum(lens_q))
    dout = torch.randn_like(out)
    sink = options.get("learnable_sink")
    leaves = (q, k, v) + ((sink,) if sink is not None else ())
    grads = torch.autograd.grad(out, leaves, dout)
    assert bool(bwd_calls) == gluon_backward, f"the Gluon backward ran {len(bwd_calls)} times"
    slopes = options.pop("alibi_slopes", None)
    options.pop("deterministic", None)  # the call's, not the oracle's
    dsink_ref, dsink_pt = 0.0, 0.0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if lq == 0:  # keys no query sees: gradient 0 (dK and dV are allocated uninitialised)
            assert (grads[1][ks] == 0).all() and (grads[2][ks] == 0).all()
            continue
        if lk == 0:  # no key: out 0, dq 0, lse +inf (the sink's value with one)
            assert (out[qs] == 0).all() and (grads[0][qs] == 0).all()
            expected = torch.full((h, lq), float("inf"), device="cuda") if sink is None else (
                sink.detach()[:, None].expand(h, lq))
            torch.testing.assert_close(lse[:, qs], expected)
            continue
        seq = dict(options, alibi_slopes=slopes if slopes is None or slopes.dim() == 1 else slopes[i])
        qi, ki, vi = (t[s][None].detach().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        sink_i = None if sink is None else sink.detach().clone().requires_grad_()
        seq["learnable_sink"] = sink_i
        ref, lse_ref = attention_ref(qi, ki, vi, **seq)
        pt, lse_pt = attention_ref(qi, ki, vi, upcast=False, **seq)
        assert_close_to_ref(out[qs][None], ref, pt, name=f"out[{i}]")
        assert_close_to_ref(lse[:, qs][None], lse_ref, lse_pt, name=f"lse[{i}]")
        inputs = (qi, ki, vi) + ((sink_i,) if sink is not None else ())
        refg = torch.autograd.grad(ref, inputs, dout[qs][None].double())
        ptg = torch.autograd.grad(pt, inputs, dout[qs][None])
        for name, g, s, r, p in zip("qkv", grads, (qs, ks, ks), refg, ptg, strict=False):
            assert_close_to_ref(g[s][None], r, p, factor=3.0, name=f"d{name}[{i}]")
        if sink is not None:
            dsink_ref, dsink_pt = dsink_ref + refg[3], dsink_pt + ptg[3]
    if sink is not None:  # the sink's gradient sums over every sequence
        assert_close_to_ref(grads[3], dsink_ref, dsink_pt, factor=3.0, name="dsink")


VARLEN_Q = [0, 1, 17, 113, 1023, 64, 300, 129, 0, 2, 200]
VARLEN_K = [5, 1, 30, 113, 900, 64, 0, 200, 3, 1500, 200]  # seqlen_q != seqlen_k both ways, empty keys


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["plain", "causal", "window", "swa+softcap", "alibi_bh+sink"])
def test_varlen_forward(ws_calls, ws_bwd_calls, features, d):
    torch.manual_seed(0)
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else _options(len(VARLEN_Q), 4, features))
    _check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, 4, 2, d, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_many_documents(ws_calls, ws_bwd_calls, causal):
    # packed documents of long-tailed lengths (many shorter than a tile, a few of several tiles), more work
    # items than SMs: the persistent programs bisect the tile list for each; fp16, GQA 4
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in (torch.rand(160, generator=g) ** 3 * 1500).long() + 1]
    lens[7] = 0
    _check_varlen(ws_calls, ws_bwd_calls, lens, lens, 16, 4, 128, torch.float16, causal=causal)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred-dq", "step-dq"])
@pytest.mark.parametrize("features", ["plain", "causal", "swa+softcap"])
def test_varlen_backward_d64_dq_orders(ws_calls, ws_bwd_calls, monkeypatch, defer, features):
    # 64-row steps at d = 64, each step's dQ computed in it or one step late; sequences ending inside a
    # 64-key half, at a tile's end, one past it, and with more keys than queries and fewer
    torch.manual_seed(0)
    use_tiles(monkeypatch, "bwd_ws=64,128,4,3")
    _vary_routes(monkeypatch, backward=dict(defer_dq=defer))
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else _options(6, 4, features))
    _check_varlen(ws_calls, ws_bwd_calls, [63, 64, 65, 128, 129, 300], [63, 130, 65, 1, 129, 257], 4, 2, 64,
                  **options)


def test_varlen_backward_grid_bound(ws_calls, ws_bwd_calls):
    # every sequence ends in a partial key tile: the grid's bound (the packed keys' whole tiles + one per
    # sequence: 15) passes the list (12 tiles), and the programs past it get no work and store nothing
    torch.manual_seed(0)
    lens = [1, 127, 129, 255, 3, 200, 1, 129]
    _check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 4, 128, causal=True)


def test_varlen_three_consumers(ws_calls, ws_bwd_calls, monkeypatch):
    # d = 64 on 192-row tiles: a sequence's last tile ends mid-warpgroup or leaves a warpgroup without rows
    use_tiles(monkeypatch, "fwd_ws=192,128,4,3")
    lens_q, lens_k = [191, 192, 193, 64, 65, 450], [191, 300, 100, 64, 65, 450]
    _check_varlen(ws_calls, ws_bwd_calls, lens_q, lens_k, 4, 2, 64, window_size=(100, 0))


# ---------------------------------------------------------- the Gluon forward at d = 256
# 32-key steps, no half-diagonal step (routes.gluon_forward_tiles); its backward is the Triton one


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (1023, 1023), (2049, 1537)])
@pytest.mark.parametrize("features", ["plain", "causal", "window", "swa+softcap", "alibi_bh+sink"])
def test_d256_forward(ws_calls, ws_bwd_calls, features, sq, sk):
    torch.manual_seed(0)
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else _options(2, 4, features))
    _check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, 256), gluon_backward=False, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_d256_forward_long_gqa_and_varlen(ws_calls, ws_bwd_calls, dtype):
    torch.manual_seed(0)
    _check_features(ws_calls, ws_bwd_calls, *_qkv(1, 4097, 4097, 4, 1, 256, dtype), causal=True,
                    gluon_backward=False)
    _check_varlen(ws_calls, ws_bwd_calls, [0, 33, 1, 300, 129], [7, 33, 2, 200, 300], 4, 2, 256, dtype,
                  causal=True)


# ---------------------------------------------------------- the Gluon forward with dv < d (192 / 128)
# Q and K padded to the tile width (TMA reads zeros past d), V and O as they are, O staged in Q's buffer;
# the backward is the Triton one


def _qkv_dv(b, sq, sk, h, hk, d, dv, dtype=torch.bfloat16):
    q, k, _ = _qkv(b, sq, sk, h, hk, d, dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("sq, sk", [(17, 17), (113, 1023), (1023, 113), (1023, 1023)])
@pytest.mark.parametrize("features", ["causal", "swa+softcap", "alibi+sink"])
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (256, 128), (96, 64)])
def test_dv_below_d(ws_calls, ws_bwd_calls, d, dv, features, sq, sk):
    torch.manual_seed(0)
    options = dict(causal=True) if features == "causal" else _options(2, 4, features)
    _check_features(ws_calls, ws_bwd_calls, *_qkv_dv(2, sq, sk, 4, 2, d, dv), gluon_backward=False, **options)


def test_dv_below_d_varlen(ws_calls, ws_bwd_calls):
    # the masked stores of a sequence's last rows are O's width, not Q's
    torch.manual_seed(0)
    _check_varlen(ws_calls, ws_bwd_calls, [0, 65, 1, 300, 129], [7, 65, 2, 200, 300], 4, 2, 192, dv=128,
                  causal=True)


def test_option_off_after_on_at_the_same_shape(ws_calls, ws_bwd_calls):
    # a softcap's float and None (compiled out) are different kernels: the second call must not take the
    # first one's launch plan
    torch.manual_seed(0)
    q, k, v = _qkv(1, 700, 700, 4, 2, 128)
    for softcap in (20.0, 0.0, 20.0):
        check_against_oracle(q, k, v, causal=True, softcap=softcap)
