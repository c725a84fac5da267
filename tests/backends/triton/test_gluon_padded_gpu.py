"""Head dims below the Gluon kernels' tile widths on a Hopper GPU (``pytest -m gpu``): d 40, 80, 96, d_v below
d, wide heads beside a narrow d_v. TMA reads the columns past d and dv as zeros and clips the stores there;
the varlen layout's masked stores of a sequence's last rows stop at the head dims. Every case runs on the
default routes and asserts that both Gluon launchers ran (routes.takes_gluon_forward / takes_gluon_backward
take the padded head dims; a head dim whose rows are not 16-byte multiples, dv 100, is not TMA-ready and
stays on Triton); the oracle checks the forward, the LSE and every gradient.
"""

from __future__ import annotations

import pytest
import torch
from gluon_helpers import check_features, check_varlen, options_for, qkv_dv

from flashattn.backends.triton import routes

pytestmark = pytest.mark.gpu

# (d, dv): Q/K and V tiles padded to 64 or 128 (attn_bwd.py at the padded width), and wide heads beside a
# dv padded to 128 or 256 (attn_bwd_dsplit.py; Q and K 192 wide beside the first, 256 beside the second)
PADDED = [(96, 96), (40, 40), (80, 80), (128, 96), (72, 64), (200, 96), (160, 104), (160, 160)]


def _check(fwd_calls, bwd_calls, q, k, v, **options):
    check_features(fwd_calls, bwd_calls, q, k, v, **options)
    d, dv = q.shape[-1], v.shape[-1]
    assert bwd_calls.routes[0].d_qk == (0 if d <= 128 else 192 if d <= 192 and dv <= 128 else 256)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 1023), (1023, 113), (2049, 1537)])
@pytest.mark.parametrize("d, dv", PADDED, ids=str)
def test_padded_head_dims(ws_calls, ws_bwd_calls, d, dv, sq, sk, causal):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, sq, sk, 4, 2, d, dv), causal=causal)


@pytest.mark.parametrize("features", ["swa+softcap", "window+alibi_bh+sink"])
@pytest.mark.parametrize("d, dv", [(96, 96), (128, 96), (200, 96)], ids=str)
def test_padded_head_dims_with_options(ws_calls, ws_bwd_calls, d, dv, features):
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, 1023, 700, 4, 2, d, dv), **options_for(2, 4, features))


@pytest.mark.parametrize("d, dv", [(96, 96), (80, 80), (128, 96), (160, 104)], ids=str)
def test_padded_head_dims_gqa_split(ws_calls, ws_bwd_calls, monkeypatch, d, dv):
    # the group split's float32 dK / dV buffers are shaped like k and v: rows of d and dv columns
    import dataclasses

    monkeypatch.setattr(routes, "backward_route",
                        lambda spec: dataclasses.replace(routes.gluon_backward_route(spec), group_split=2))
    torch.manual_seed(0)
    _check(ws_calls, ws_bwd_calls, *qkv_dv(2, 300, 1100, 8, 2, d, dv), causal=True)


@pytest.mark.parametrize("d, dv", [(96, 96), (128, 96), (160, 104)], ids=str)
def test_padded_head_dims_varlen(ws_calls, ws_bwd_calls, d, dv):
    # sequences ending inside tiles: O's, dK's and dV's last rows by masked stores stopping at the head dims
    torch.manual_seed(0)
    check_varlen(ws_calls, ws_bwd_calls, [0, 65, 1, 300, 129, 0], [7, 65, 2, 200, 300, 0], 4, 2, d, dv=dv,
                 gluon_backward=True, causal=True)
