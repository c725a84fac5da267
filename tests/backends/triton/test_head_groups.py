"""head_groups.py and routes.backward_head_groups: the backward of calls whose float32 dQ buffer would pass
routes.DQ_BUFFER_CAP, run by groups of heads. The group count is checked on shapes alone; the grouped
backward (the Triton kernels under TRITON_INTERPRET=1, the caps lowered so that small calls split) must give
the whole call's gradients bit for bit in groups of whole KV heads, every per-head option (ALiBi (h,) and
(b, h), a sink) sliced with its heads, and match the oracle where a KV head's query heads go in parts."""

from __future__ import annotations

import pytest
import torch
from utils import INTERPRET

from flashattn import config as flashattn_config
from flashattn import flash_attn_func, flash_attn_varlen_func
from flashattn.backends.triton import attention, routes

MIB = 1 << 20


@pytest.mark.parametrize("shape, heads_k, dropout, groups", [
    ((1, 131072, 16, 128), 16, 0.0, 16),  # 1 GiB of buffer: 64 MiB groups, one KV head each
    ((1, 131072, 16, 128), 8, 0.0, 8),  # GQA 16/8: 128 MiB a KV head's share, over DQ_GROUP_BYTES: one each
    ((1, 131072, 32, 128), 8, 0.0, 8),  # GQA 32/8: 256 MiB a KV head, under the cap
    ((1, 65536, 16, 128), 16, 0.0, 1),  # 512 MiB: at the cap, one buffer
    ((1, 32768, 16, 128), 16, 0.0, 1),
    ((1, 131072, 16, 128), 16, 0.1, 1),  # dropout's stream is indexed by head
    ((1, 131072, 16, 128), 1, 0.0, 16),  # MQA: the one KV head's query heads in 16 parts of 64 MiB
    ((1, 262144, 32, 128), 2, 0.0, 32),  # 2 GiB a KV head: its 16 query heads in parts, 128 MiB each
    ((1, 2097152, 1, 128), 1, 0.0, 1),  # one head of 1 GiB: nothing to split
    ((131072, 16, 128), 4, 0.0, 4),  # varlen layout: 1 GiB over 4 KV heads
    ((4, 65536, 16, 64), 16, 0.0, 16),  # batch 4 at d 64: 1 GiB as well
])
def test_head_groups_count(shape, heads_k, dropout, groups):
    dq_bytes = torch.empty(shape, device="meta").numel() * 4
    assert routes.backward_head_groups(dq_bytes, shape[-2], heads_k, dropout > 0) == groups


def _caps(monkeypatch, nbytes):
    """The dQ buffer cap and the groups' size both nbytes: small calls split."""
    monkeypatch.setattr(routes, "DQ_BUFFER_CAP", nbytes)
    monkeypatch.setattr(routes, "DQ_GROUP_BYTES", nbytes)


@pytest.fixture
def split_small_calls(monkeypatch):
    """The Triton backend, and a record of attention_backward's calls through the module (q's shape): the
    groups', and the whole call's where the op layer looks it up there."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    real = attention.attention_backward

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        calls.grads.append(kwargs.get("grads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "attention_backward", counting)
    calls = _Calls()
    return calls


class _Calls(list):
    """q's shape of each call; `grads`: the gradient views each was given to write into (or None)."""

    def __init__(self):
        super().__init__()
        self.grads = []


def _grads(fn, inputs, seed=0):
    torch.manual_seed(seed)
    out = fn()
    return torch.autograd.grad(out, inputs, torch.randn_like(out))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
@pytest.mark.parametrize("alibi_shape", [(4,), (2, 4)], ids=["alibi_h", "alibi_bh"])
def test_grouped_backward_equals_the_whole_one(split_small_calls, monkeypatch, alibi_shape):
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 32, requires_grad=True)
    k, v = (torch.randn(2, 45, 2, 32, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, requires_grad=True)
    alibi = torch.rand(alibi_shape)
    options = dict(causal=True, window_size=(20, -1), softcap=5.0, alibi_slopes=alibi, learnable_sink=sink)
    inputs = (q, k, v, sink)
    _caps(monkeypatch, q.numel() * 4 // 2)  # two groups
    grouped = _grads(lambda: flash_attn_func(q, k, v, **options), inputs)
    # two groups of one KV head and its two query heads, each a call of its own, writing its gradients
    # straight into the whole call's (views of its heads: no copy)
    assert [s[2] for s in split_small_calls if s[2] < 4] == [2, 2]
    views = [g for g, s in zip(split_small_calls.grads, split_small_calls, strict=True) if s[2] < 4]
    assert all(g is not None and g[0].shape[2] == 2 and g[1].shape[2] == 1 for g in views)
    assert views[0][0].data_ptr() != views[1][0].data_ptr()
    assert views[0][0].untyped_storage().data_ptr() == views[1][0].untyped_storage().data_ptr()
    monkeypatch.setattr(routes, "DQ_BUFFER_CAP", 1 << 40)
    whole = _grads(lambda: flash_attn_func(q, k, v, **options), inputs)
    for g, w in zip(grouped, whole, strict=True):
        assert torch.equal(g, w)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
def test_grouped_varlen_backward_equals_the_whole_one(split_small_calls, monkeypatch):
    torch.manual_seed(0)
    lens_q, lens_k = [0, 17, 40], [5, 30, 33]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                  for ls in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), 4, 32, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 4, 32, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, requires_grad=True)

    def call():
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                      alibi_slopes=torch.linspace(0.1, 0.4, 4), learnable_sink=sink)

    _caps(monkeypatch, q.numel() * 4 // 4)  # four groups
    grouped = _grads(call, (q, k, v, sink))
    assert [s[1] for s in split_small_calls if s[1] < 4] == [1, 1, 1, 1]
    monkeypatch.setattr(routes, "DQ_BUFFER_CAP", 1 << 40)
    whole = _grads(call, (q, k, v, sink))
    for g, w in zip(grouped, whole, strict=True):
        assert torch.equal(g, w)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set at process start")
@pytest.mark.parametrize("heads_k, parts", [(1, 2), (2, 4)], ids=["mqa-2-parts", "gqa-4-parts"])
def test_parts_of_a_kv_heads_query_heads(split_small_calls, monkeypatch, heads_k, parts):
    # a KV head's share over the cap: its query heads in parts, their dK and dV summed in float32
    from test_interface import check_against_oracle

    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 32, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(2, 45, heads_k, 32, dtype=torch.float16, requires_grad=True) for _ in range(2))
    sink = torch.randn(4, requires_grad=True)
    total = q.numel() * 4
    monkeypatch.setattr(routes, "DQ_BUFFER_CAP", total // parts)
    monkeypatch.setattr(routes, "DQ_GROUP_BYTES", total // parts)
    assert routes.backward_head_groups(total, 4, heads_k, False) == parts
    check_against_oracle(q, k, v, wrt=(q, k, v, sink), causal=True, softcap=5.0, learnable_sink=sink,
                         alibi_slopes=torch.rand(2, 4))
    assert [s[2] for s in split_small_calls if s[2] < 4] == [4 // parts] * parts
    # parts of a KV head's query heads sum their dK and dV: given no views
    assert all(g is None for g, s in zip(split_small_calls.grads, split_small_calls, strict=True) if s[2] < 4)
