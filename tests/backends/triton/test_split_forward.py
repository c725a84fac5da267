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


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
def test_split_forward_keeps_the_streams_workspace(monkeypatch, launches):
    """Its split partials and counters live in the stream's workspace (decode.stream_workspace): no
    allocation and no zeroing per call, grown for a launch that needs more, the counters left at 0; the
    results bit for bit those of a workspace allocated per call."""
    from flashattn import flash_attn_func
    from flashattn.backends.triton import decode

    monkeypatch.setattr(flashattn_config, "backend", "triton")
    monkeypatch.setattr(decode, "_stream_workspaces", {})
    splits = {}
    monkeypatch.setattr(routes, "forward_route",
                        lambda spec: decode_routes.SplitForward(num_splits=splits["n"]))

    def call(seed, n, sk):
        splits["n"] = n
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 3, 4, 32, generator=g, dtype=torch.float16)
        k, v = (torch.randn(2, sk, 2, 32, generator=g, dtype=torch.float16) for _ in range(2))
        return flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]

    cases = ((0, 2, 64), (1, 2, 48), (2, 4, 96))
    outs, sizes = [], []
    for seed, n, sk in cases:
        outs.append(call(seed, n, sk))
        (ws,) = decode._stream_workspaces.values()
        assert torch.count_nonzero(ws.counters) == 0
        sizes.append(ws.partials.numel())
    assert sizes[0] == sizes[1] < sizes[2]  # kept for the second 2-split call, grown for the 4-split one
    assert launches["decode_kernel"] == 3
    monkeypatch.setattr(decode, "stream_workspace", lambda *args: None)
    for (seed, n, sk), (out, lse) in zip(cases, outs, strict=True):
        fresh, fresh_lse = call(seed, n, sk)
        assert torch.equal(out, fresh) and torch.equal(lse, fresh_lse)
