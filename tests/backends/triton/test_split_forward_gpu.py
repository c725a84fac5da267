"""The split-KV forward (decode_routes.SplitForward) on a Hopper GPU (``pytest -m gpu``): forwards of few
query rows on the decode kernel, a GQA group's rows packed, on its explicit route; forward, LSE and the
default backward's gradients against the fp64 oracle, asserting that the decode kernel ran."""

from __future__ import annotations

import pytest
import torch
from gluon_helpers import qkv
from test_interface import check_against_oracle

from flashattn import config as flashattn_config
from flashattn.backends.triton import attention, decode, decode_routes, routes

pytestmark = pytest.mark.gpu


@pytest.fixture
def decode_calls(monkeypatch):
    """The decode launcher's calls (q's shape), on the Triton backend, no forward signature cached."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    monkeypatch.setattr(attention, "_forward_cache", {})
    calls = []
    launcher = decode.kvcache_forward

    def record(q, *args, **kwargs):
        calls.append(q.shape)
        return launcher(q, *args, **kwargs)

    monkeypatch.setattr(decode, "kvcache_forward", record)
    return calls


@pytest.fixture
def split_calls(monkeypatch, decode_calls):
    """The split-KV route wherever it takes the call; the decode launcher's calls (q's shape)."""
    real = routes.forward_route
    monkeypatch.setattr(routes, "forward_route", lambda spec: decode_routes.SplitForward()
                        if decode_routes.takes_split_forward(spec) else real(spec))
    return decode_calls


@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 4097), (7, 1023), (16, 16), (64, 1100), (33, 65)], ids=str)
@pytest.mark.parametrize("h, hk, d", [(32, 8, 128), (8, 1, 64), (4, 4, 256), (8, 2, 96)], ids=str)
@pytest.mark.parametrize("options", ["causal", "full", "window+softcap+alibi"])
def test_split_forward(split_calls, sq, sk, h, hk, d, options):
    torch.manual_seed(0)
    q, k, v = qkv(2, sq, sk, h, hk, d)
    kwargs = {"causal": dict(causal=True), "full": {},
              "window+softcap+alibi": dict(causal=True, window_size=(100, -1), softcap=30.0,
                                           alibi_slopes=torch.rand(2, h, device="cuda"))}[options]
    check_against_oracle(q, k, v, **kwargs)
    assert split_calls == [q.shape]


def test_default_route_repeats_through_the_signature_cache(decode_calls):
    """A few-row forward takes the split-KV kernel by default; its repeat (the same signature) comes from the
    forward's signature cache and still runs the decode kernel, with the same result bit for bit."""
    torch.manual_seed(0)
    q, k, v = qkv(1, 4, 4096, 32, 8, 128)
    first = attention.attention_forward(q, k, v, softmax_scale=0.125, causal=True)
    assert len(attention._forward_cache) == 1
    second = attention.attention_forward(q, k, v, softmax_scale=0.125, causal=True)
    assert decode_calls == [q.shape, q.shape]
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_split_forward_in_a_cuda_graph(decode_calls):
    """Eager calls keep their split partials in the stream's workspace; a captured call allocates its own in
    the graph's pool (decode.stream_workspace is None while capturing), so replays with new inputs equal
    eager calls bit for bit, and the stream's workspace is left as it was."""
    torch.manual_seed(0)
    q, k, v = (t.detach() for t in qkv(1, 4, 4096, 32, 8, 128))
    eager = attention.attention_forward(q, k, v, softmax_scale=0.125, causal=True)
    workspaces = dict(decode._stream_workspaces)
    static = (q.clone(), k.clone(), v.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention.attention_forward(*static, softmax_scale=0.125, causal=True)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention.attention_forward(*static, softmax_scale=0.125, causal=True)
    for seed in range(3):
        torch.manual_seed(seed + 1)
        fresh = tuple(t.detach() for t in qkv(1, 4, 4096, 32, 8, 128))
        for dst, src in zip(static, fresh, strict=True):
            dst.copy_(src)
        graph.replay()
        expected = attention.attention_forward(*fresh, softmax_scale=0.125, causal=True)
        assert torch.equal(captured[0], expected[0]) and torch.equal(captured[1], expected[1])
    assert all(decode._stream_workspaces.get(key) is ws for key, ws in workspaces.items())
    assert len(decode_calls) == 3 + 3 and eager[0].shape == q.shape
