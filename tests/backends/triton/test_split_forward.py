"""The split-KV forward (decode_routes.SplitForward): a dense forward of few query rows on the decode
kernel, a GQA group's rows packed into its query blocks. Routing (what it takes and refuses) on specs; the
forward itself under TRITON_INTERPRET=1 against the fp64 oracle (forward, LSE, and the gradients of the
default backward reading its output and LSE), asserting that the decode kernel ran."""

from __future__ import annotations

import pytest
import torch
from test_interface import check_against_oracle
from utils import INTERPRET

from flashattn import config as flashattn_config
from flashattn.backends.triton import decode_routes, routes
from flashattn.errors import FlashAttnError


def _spec(**kw):
    base = dict(batch=2, nheads=32, nheads_k=8, seqlen_q=16, seqlen_k=4096, headdim=128, headdim_v=128,
                window=(-1, 0))
    return routes.Spec(**{**base, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(seqlen_q=1), dict(seqlen_q=64, seqlen_k=64), dict(headdim=40,
                                headdim_v=40), dict(window=(100, 0), softcap=True, alibi=True),
                                dict(dtype="float32"), dict(headdim=256, headdim_v=256)], ids=str)
def test_split_forward_takes(kw):
    assert decode_routes.split_forward_route(_spec(**kw)) == decode_routes.SplitForward()


@pytest.mark.parametrize("kw", [dict(seqlen_q=65), dict(seqlen_q=32, seqlen_k=31), dict(varlen=True),
                                dict(dropout=True), dict(sink=True), dict(headdim_v=64),
                                dict(headdim=288, headdim_v=288), dict(dtype="float8_e4m3fn",
                                                                        out_dtype="bfloat16")], ids=str)
def test_split_forward_refuses(kw):
    assert not decode_routes.takes_split_forward(_spec(**kw))
    with pytest.raises(FlashAttnError, match="split-KV forward takes"):
        decode_routes.split_forward_route(_spec(**kw))


@pytest.fixture
def split_route(monkeypatch, launches):
    """Every forward the split-KV forward takes on its route, the rest on their default ones; the
    interpreted launches by kernel (conftest.py's `launches`)."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    real = routes.forward_route
    monkeypatch.setattr(routes, "forward_route", lambda spec: decode_routes.SplitForward()
                        if decode_routes.takes_split_forward(spec) else real(spec))
    return launches


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("sq, sk, h, hk, d", [(1, 113, 4, 1, 64), (5, 40, 4, 2, 32), (17, 70, 4, 4, 40)],
                         ids=str)
@pytest.mark.parametrize("options", ["causal", "full", "window+softcap+alibi"])
def test_split_forward_against_the_oracle(split_route, dtype, sq, sk, h, hk, d, options):
    torch.manual_seed(0)
    q = torch.randn(2, sq, h, d).to(dtype).requires_grad_(True)
    k, v = (torch.randn(2, sk, hk, d).to(dtype).requires_grad_(True) for _ in range(2))
    kwargs = {"causal": dict(causal=True), "full": {},
              "window+softcap+alibi": dict(causal=True, window_size=(9, -1), softcap=3.0,
                                           alibi_slopes=torch.rand(2, h))}[options]
    check_against_oracle(q, k, v, **kwargs)
    assert split_route["decode_kernel"] == 1 and "attn_fwd_kernel" not in split_route
