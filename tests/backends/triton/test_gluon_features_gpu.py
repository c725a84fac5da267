"""The training features on both Gluon kernels on a Hopper GPU (``pytest -m gpu``): windows (alone and with
causal), softcap, ALiBi and learnable sinks, compile-time variants of both kernels, alone, in pairs, at odd
lengths and at tile boundaries. Each case asserts that both launchers ran (conftest.py's spies) and checks
the forward, the LSE and every gradient (the sink's included) against the oracle.
"""

from __future__ import annotations

import pytest
import torch
from gluon_helpers import (
    VARLEN_K,
    VARLEN_Q,
    check_features,
    check_varlen,
    options_for,
    qkv_dv,
    takes_gluon_backward,
)
from gluon_helpers import qkv as _qkv
from gluon_helpers import vary_routes as _vary_routes
from test_interface import check_against_oracle
from utils import use_tiles

pytestmark = pytest.mark.gpu


# ---------------------------------------------------------- the training features on the Gluon kernels
# Windows (alone and with causal), softcap, ALiBi and learnable sinks are compile-time variants of both Gluon
# kernels. Each case asserts that both launchers ran, and checks the forward, the LSE and every gradient (the
# sink's included) against the oracle.


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
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, d), **options_for(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(113, 1023), (1023, 113), (1023, 1023)])
@pytest.mark.parametrize("features", PAIRS)
def test_feature_pairs(ws_calls, ws_bwd_calls, features, sq, sk, d):
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, d), **options_for(2, 4, features))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("features, d", [("swa+sink", 64), ("sink", 128), ("alibi+sink", 64)])
def test_sink_gradient_over_draws(ws_calls, ws_bwd_calls, features, d, seed):
    # the sink's gradient sums P_sink · rowsum(P ∘ dP) over every row: taken from the rounded output's D it
    # passed plain PyTorch's error several-fold on some draws (swa+sink 113 x 1023 at d = 64: 5x); the
    # kernel sums it from its float32 P and dP
    torch.manual_seed(seed)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, 113, 1023, 4, 2, d), **options_for(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["swa", "window", "softcap+alibi", "swa+sink"])
def test_features_at_4097(ws_calls, ws_bwd_calls, features, d):
    # past 4K at d = 64 the forward takes three consumer warpgroups (a band wider than 4K, or none)
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *_qkv(1, 4097, 4097, 2, 1, d), **options_for(1, 2, features))


# windows whose edges fall on and beside tile boundaries (64-row warpgroups, 128-key tiles, 192-row tiles),
# with the diagonal shifted both ways by seqlen_q != seqlen_k
WINDOW_EDGES = [(127, 0), (128, 0), (63, 64), (64, 64), (191, 1), (192, 0), (0, 0), (0, 127), (-1, 128),
                (128, -1), (1, 1)]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(1024, 1024), (1024, 1088), (1088, 1024), (1152, 1152)])
@pytest.mark.parametrize("window", WINDOW_EDGES, ids=str)
def test_window_edges_at_tile_boundaries(ws_calls, ws_bwd_calls, window, sq, sk, d):
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 4, d), window_size=window)


@pytest.mark.parametrize("tiles", ["fwd_ws=192,128,4,3", "fwd_ws=128,128,4,3"], ids=["three", "two"])
@pytest.mark.parametrize("window", [(255, 0), (130, 70), (-1, 65), (300, -1)], ids=str)
def test_window_d64_consumer_counts(ws_calls, ws_bwd_calls, monkeypatch, tiles, window):
    # three consumer warpgroups run serial steps with their own half-diagonal step: both counts per band
    use_tiles(monkeypatch, tiles)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, 1500, 1400, 4, 2, 64), window_size=window)


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
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, 1100, 1300, 4, 2, 64), **options_for(2, 4, features))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["window", "swa", "softcap", "sink"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_features_dtypes_and_gqa(ws_calls, ws_bwd_calls, dtype, features, d):
    torch.manual_seed(0)
    for h, hk in ((8, 1), (12, 4)):
        check_features(ws_calls, ws_bwd_calls, *_qkv(2, 700, 1100, h, hk, d, dtype),
                        **options_for(2, h, features))


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("window, sq, sk", [((20, 10), 300, 100), ((-1, 0), 1400, 3), ((50, 0), 700, 190),
                                            ((5, 5), 1000, 64)], ids=str)
def test_rows_without_keys_under_a_band(ws_calls, ws_bwd_calls, window, sq, sk, sink):
    # the first sq - sk - right rows end before key 0: out 0, dq 0, lse +inf (the sink's value with one),
    # never NaN; query tiles with no key at all, and key tiles no query sees (dk = dv = 0)
    n = sq - sk - window[1]
    options = options_for(1, 2, "sink") if sink else {}
    floor = "rounding" if sk <= 3 else None  # see tests/test_interface.py::test_fully_masked_rows
    out, lse, grads = check_features(ws_calls, ws_bwd_calls, *_qkv(1, sq, sk, 2, 2, 128), window_size=window,
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
    _, _, (_, dk, dv) = check_features(ws_calls, ws_bwd_calls, *_qkv(1, sq, sk, 2, 2, 128),
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
    check_features(ws_calls, ws_bwd_calls, q, k, v, softcap=softcap, causal=True)


def test_extreme_sinks(ws_calls, ws_bwd_calls):
    # a sink far above every score takes nearly all the mass (out ~ 0, lse ~ sink), one far below none
    sink = torch.tensor([30.0, -30.0, 0.0, 5.0], device="cuda", requires_grad=True)
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, 500, 700, 4, 2, 64), learnable_sink=sink,
                    window_size=(128, 0))


# ---------------------------------------------------------- the Gluon kernels on packed sequences (varlen)
# Each case checks the forward, LSE and gradients sequence by sequence against the oracle; the backward is
# the Gluon one at d = dv = 64 or 128 (asserted), else the Triton one, reading the Gluon forward's LSE.



@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("features", ["plain", "causal", "window", "swa+softcap", "alibi_bh+sink"])
def test_varlen_forward(ws_calls, ws_bwd_calls, features, d):
    torch.manual_seed(0)
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else options_for(len(VARLEN_Q), 4, features))
    check_varlen(ws_calls, ws_bwd_calls, VARLEN_Q, VARLEN_K, 4, 2, d, **options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_many_documents(ws_calls, ws_bwd_calls, causal):
    # packed documents of long-tailed lengths (many shorter than a tile, a few of several tiles), more work
    # items than SMs: the persistent programs bisect the tile list for each; fp16, GQA 4
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in (torch.rand(160, generator=g) ** 3 * 1500).long() + 1]
    lens[7] = 0
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, 16, 4, 128, torch.float16, causal=causal)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred-dq", "step-dq"])
@pytest.mark.parametrize("features", ["plain", "causal", "swa+softcap"])
def test_varlen_backward_d64_dq_orders(ws_calls, ws_bwd_calls, monkeypatch, defer, features):
    # 64-row steps at d = 64, each step's dQ computed in it or one step late; sequences ending inside a
    # 64-key half, at a tile's end, one past it, and with more keys than queries and fewer
    torch.manual_seed(0)
    use_tiles(monkeypatch, "bwd_ws=64,128,4,3")
    _vary_routes(monkeypatch, backward=dict(defer_dq=defer))
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else options_for(6, 4, features))
    check_varlen(ws_calls, ws_bwd_calls, [63, 64, 65, 128, 129, 300], [63, 130, 65, 1, 129, 257], 4, 2, 64,
                  **options)


def test_varlen_backward_grid_bound(ws_calls, ws_bwd_calls):
    # every sequence ends in a partial key tile: the grid's bound (the packed keys' whole tiles + one per
    # sequence: 15) passes the list (12 tiles), and the programs past it get no work and store nothing
    torch.manual_seed(0)
    lens = [1, 127, 129, 255, 3, 200, 1, 129]
    check_varlen(ws_calls, ws_bwd_calls, lens, lens, 4, 4, 128, causal=True)


def test_varlen_three_consumers(ws_calls, ws_bwd_calls, monkeypatch):
    # d = 64 on 192-row tiles: a sequence's last tile ends mid-warpgroup or leaves a warpgroup without rows
    use_tiles(monkeypatch, "fwd_ws=192,128,4,3")
    lens_q, lens_k = [191, 192, 193, 64, 65, 450], [191, 300, 100, 64, 65, 450]
    check_varlen(ws_calls, ws_bwd_calls, lens_q, lens_k, 4, 2, 64, window_size=(100, 0))


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_kept_launches_with_other_lengths(ws_calls, ws_bwd_calls, monkeypatch, d):
    # the same tokens packed into as many documents, the longest the same: the second call runs the first's
    # kept launches (attention.py's signature cache), forward and backward, on its own cu_seqlens
    from flashattn.backends.triton import attention, gluon

    monkeypatch.setattr(attention, "_backward_cache", {})
    prepared = []
    for name in ("_prepare_forward", "_prepare_backward"):
        real = getattr(gluon, name)
        monkeypatch.setattr(gluon, name, lambda *a, _real=real, **kw: prepared.append(a) or _real(*a, **kw))
    torch.manual_seed(0)
    check_varlen(ws_calls, ws_bwd_calls, [300, 17, 113, 1, 0], [300, 17, 113, 1, 0], 4, 2, d, causal=True)
    assert len(prepared) == 2
    check_varlen(ws_calls, ws_bwd_calls, [1, 0, 113, 300, 17], [1, 0, 113, 300, 17], 4, 2, d, causal=True)
    assert len(prepared) == 2 and len(ws_calls) == len(ws_bwd_calls) == 2


# ---------------------------------------------------------- the Gluon forward at d = 256
# 64-key steps beside one Q buffer, no half-diagonal step (routes.gluon_forward_tiles); its backward is the
# wide-head Gluon one (attn_bwd_dsplit.py)


@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (1023, 1023), (2049, 1537)])
@pytest.mark.parametrize("features", ["plain", "causal", "window", "swa+softcap", "alibi_bh+sink"])
def test_d256_forward(ws_calls, ws_bwd_calls, features, sq, sk):
    torch.manual_seed(0)
    options = {} if features == "plain" else (
        dict(causal=True) if features == "causal" else options_for(2, 4, features))
    check_features(ws_calls, ws_bwd_calls, *_qkv(2, sq, sk, 4, 2, 256), **options)
    assert ws_bwd_calls.routes[0].d_qk == 256


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_d256_forward_long_gqa_and_varlen(ws_calls, ws_bwd_calls, dtype):
    torch.manual_seed(0)
    check_features(ws_calls, ws_bwd_calls, *_qkv(1, 4097, 4097, 4, 1, 256, dtype), causal=True)
    check_varlen(ws_calls, ws_bwd_calls, [0, 33, 1, 300, 129], [7, 33, 2, 200, 300], 4, 2, 256, dtype,
                  causal=True)


# ---------------------------------------------------------- the Gluon forward with dv < d (192 / 128)
# Q and K padded to the tile width (TMA reads zeros past d; 129..192 to 192, in three 64-wide chunks), V and
# O as they are, O staged in Q's buffer; the backward is the wide-head Gluon one where it takes (d, dv)
# (gluon_helpers.takes_gluon_backward), else the Triton one


@pytest.mark.parametrize("sq, sk", [(17, 17), (113, 1023), (1023, 113), (1023, 1023)])
@pytest.mark.parametrize("features", ["causal", "swa+softcap", "alibi+sink"])
@pytest.mark.parametrize("d, dv", [(192, 128), (128, 64), (256, 128), (96, 64)])
def test_dv_below_d(ws_calls, ws_bwd_calls, d, dv, features, sq, sk):
    torch.manual_seed(0)
    options = dict(causal=True) if features == "causal" else options_for(2, 4, features)
    check_features(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 4, 2, d, dv),
                    gluon_backward=takes_gluon_backward(d, dv), **options)


# (d, dv, tile override, Q's width, its Q buffers): d 129..192 in three 64-wide chunks of Q and K, on one Q
# buffer beside the 128-key ring (O staged over its first two chunks) or two beside a 64-key ring; d = 256
# on one Q buffer beside a 64-key ring
CHUNKED = [(192, 128, None, 192, 1), (160, 128, None, 192, 1), (192, 64, None, 192, 2),
           (192, 128, "fwd_ws=128,64,4,3", 192, 2), (256, 256, "fwd_ws=128,64,4,2", 256, 1)]


@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("features", ["causal", "swa+softcap", "window+alibi_bh+sink"])
@pytest.mark.parametrize("d, dv, tiles, width, q_buffers", CHUNKED, ids=str)
def test_chunked_heads_and_one_q_buffer(ws_calls, ws_bwd_calls, monkeypatch, d, dv, tiles, width, q_buffers,
                                        features, sq, sk):
    torch.manual_seed(0)
    if tiles:
        use_tiles(monkeypatch, tiles)
    options = dict(causal=True) if features == "causal" else options_for(2, 4, features)
    check_features(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 4, 2, d, dv),
                    gluon_backward=takes_gluon_backward(d, dv), **options)
    route = ws_calls.routes[0]
    assert (route.head_dim, route.q_buffers, route.defer_release) == (width, q_buffers, q_buffers == 2)


@pytest.mark.parametrize("d, dv, tiles, width, q_buffers", CHUNKED, ids=str)
def test_chunked_heads_and_one_q_buffer_over_many_tiles_a_program(ws_calls, ws_bwd_calls, monkeypatch, d, dv,
                                                                   tiles, width, q_buffers):
    # 4 x 8 heads x 33 query tiles over 132 programs: each program reuses its Q buffer(s) for ~8 tiles of
    # unequal causal work, the one-buffer phases included
    torch.manual_seed(0)
    if tiles:
        use_tiles(monkeypatch, tiles)
    check_features(ws_calls, ws_bwd_calls, *qkv_dv(4, 4097, 4097, 8, 2, d, dv), grads=False, causal=True)
    assert ws_calls.routes[0].q_buffers == q_buffers


def test_dv_below_d_varlen(ws_calls, ws_bwd_calls):
    # the masked stores of a sequence's last rows are O's width, not Q's
    torch.manual_seed(0)
    check_varlen(ws_calls, ws_bwd_calls, [0, 65, 1, 300, 129], [7, 65, 2, 200, 300], 4, 2, 192, dv=128,
                  causal=True)


def test_option_off_after_on_at_the_same_shape(ws_calls, ws_bwd_calls):
    # a softcap's float and None (compiled out) are different kernels: the second call must not take the
    # first one's launch plan
    torch.manual_seed(0)
    q, k, v = _qkv(1, 700, 700, 4, 2, 128)
    for softcap in (20.0, 0.0, 20.0):
        check_against_oracle(q, k, v, causal=True, softcap=softcap)
