"""torch.compile through flashattn: no graph breaks, no recompilation at a fixed shape, one compilation for
a dynamic sequence length, and the registered ops pass torch.library.opcheck.

On the CPU the op bodies run the torch backend (or the Triton interpreter under TRITON_INTERPRET=1); dynamo
only sees the registered ops and their fake implementations, which is what these tests are about (opcheck
compares the fakes' shapes and strides with the real outputs). Inductor is exercised by the GPU tests at the
bottom, with the Triton kernels and CUDA graphs: on a fresh CPU machine its first compile alone builds C++ for
about 45 s.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import flashattn
from flashattn import config as flashattn_config
from flashattn.modules import MultiHeadAttention
from flashattn.ops import registry

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch"] + (["triton"] if HAS_CUDA or INTERPRET else [])

_CASES = [
    pytest.param("torch", "gqa-causal"),
    pytest.param("torch", "packed-qkv"),
    pytest.param("torch", "sq>sk-causal"),
    # permuted inputs: the fake gradients must be contiguous like the real ones (opcheck compares strides)
    pytest.param("torch", "bhsd-transposed"),
]
if "triton" in BACKENDS:
    # one strided case through the Triton launchers (interpreted on the CPU: slow, so small and just one)
    _CASES.append(pytest.param("triton", "packed-qkv"))


@pytest.fixture(autouse=True)
def _torch_backend_off_gpu(request, monkeypatch):
    # what is under test is the op registration, which every backend shares; CI runs with TRITON_INTERPRET=1,
    # which would otherwise interpret the kernels in every call (minutes). GPU tests keep the Triton kernels.
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(flashattn_config, "backend", "torch")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _attn_loss(q, k, v):
    return flashattn.flash_attn_func(q, k, v, causal=True).square().sum()


def _inputs(b=2, s=48, h=4, hk=2, d=32, device="cpu", dtype=torch.float32):
    return [torch.randn(b, s, n, d, device=device, dtype=dtype, requires_grad=True) for n in (h, hk, hk)]


def _grads(fn, inputs):
    loss = fn(*inputs)
    return [loss, *torch.autograd.grad(loss, inputs)]


def test_explain_finds_one_graph_and_no_breaks():
    explanation = torch._dynamo.explain(_attn_loss)(*_inputs())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_fullgraph_forward_backward_matches_eager(compiler):
    inputs = _inputs()
    compiled = torch.compile(_attn_loss, fullgraph=True, backend=compiler)
    got, expected = _grads(compiled, inputs), _grads(_attn_loss, inputs)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_aot_traced_graphs_hold_the_ops_not_their_bodies():
    # AOTAutograd without dynamo (as in torch.compile's backward on torch versions where
    # torch.compiler.is_compiling() is False there): the tracer's tensors must reach the registered ops, not
    # the implementations (a kernel launch on them fails, and the torch backend's body would be inlined)
    from functorch.compile import aot_function

    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            return gm
        return compiler

    inputs = _inputs()
    compiled = aot_function(_attn_loss, fw_compiler=keep("fwd"), bw_compiler=keep("bwd"))
    for a, b in zip(_grads(compiled, inputs), _grads(_attn_loss, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert "flashattn.attn_fwd.default" in graphs["fwd"], graphs["fwd"]
    assert "flashattn.attn_bwd.default" in graphs["bwd"], graphs["bwd"]
    inlined = ("aten.exp.", "aten.exp2.", "aten._softmax", "aten.einsum")
    assert not any(t.startswith(inlined) for t in graphs["fwd"] | graphs["bwd"]), graphs


def test_no_recompilation_at_a_fixed_shape():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attn_loss, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            _grads(compiled, _inputs())  # fresh tensors, same shapes
    assert counter.frame_count == 1


def test_dynamic_seqlen_compiles_once():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_attn_loss, fullgraph=True, backend=counter)
    for s in (40, 57, 113):
        inputs = _inputs(s=s)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 1)
        for a, b in zip(_grads(compiled, inputs), _grads(_attn_loss, inputs), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_packed_and_strided_inputs_compile():
    def fn(qkv):
        return flashattn.flash_attn_qkvpacked_func(qkv, causal=True).sum()

    qkv = torch.randn(2, 33, 3, 4, 16, requires_grad=True)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(qkv), qkv)
    (g_eager,) = torch.autograd.grad(fn(qkv), qkv)
    torch.testing.assert_close(g, g_eager, rtol=0, atol=0)


def test_multihead_attention_module_compiles_without_breaks():
    torch.manual_seed(0)
    m = MultiHeadAttention(64, 4, num_heads_kv=2, causal=True, rotary_dim=8)
    x = torch.randn(2, 30, 64, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, fullgraph=True, backend=counter)
    out = compiled(x)
    torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and m.Wqkv.weight.grad is not None
    compiled(torch.randn(2, 30, 64, requires_grad=True))
    assert counter.frame_count == 1


class _RecordOps(TorchDispatchMode):
    """Records every call of a flashattn:: op, whatever its schema is."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "flashattn":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _no_double_backward(func, args, kwargs):
    """The backward op is not itself differentiable (like flash_attn's): check it on detached inputs."""
    if func.name() != "flashattn::attn_bwd":
        return args, kwargs
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, (args, kwargs))


def _recorded_calls(fn, inputs):
    with _RecordOps() as rec:
        out = fn(*inputs)
        torch.autograd.grad(out, inputs, torch.randn_like(out))
    return rec.calls


@pytest.mark.parametrize("attn_backend, case", _CASES)
def test_opcheck_registered_ops(attn_backend, case, monkeypatch):
    # schema, fake (meta) shapes and strides, autograd registration and AOT dispatch of every op a call
    # reaches, with the arguments the public API really passes
    monkeypatch.setattr(flashattn_config, "backend", attn_backend)
    # eager calls skip the registered ops (their dispatch costs more than small kernels); route through them
    monkeypatch.setattr(registry, "_registered_only", True)
    if case == "gqa-causal":
        inputs, fn = _inputs(s=37), lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True)
    elif case == "packed-qkv":
        inputs, fn = [torch.randn(1, 9, 3, 1, 16, requires_grad=True)], flashattn.flash_attn_qkvpacked_func
    elif case == "sq>sk-causal":
        q = torch.randn(1, 40, 2, 16, requires_grad=True)
        k, v = (torch.randn(1, 24, 2, 16, requires_grad=True) for _ in range(2))
        inputs, fn = [q, k, v], lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True)
    else:
        # what transformers hands over: (b, h, s, d) tensors transposed to (b, s, h, d) views
        inputs = [torch.randn(2, 4, 21, 16).transpose(1, 2).requires_grad_() for _ in range(3)]
        fn = flashattn.flash_attn_func
    calls = _recorded_calls(fn, inputs)
    assert {c[0].name() for c in calls} >= {"flashattn::attn_fwd", "flashattn::attn_bwd"}
    for func, args, kwargs in calls:
        torch.library.opcheck(func, *_no_double_backward(func, args, kwargs))


# -- GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_inductor_fullgraph_static_and_dynamic():
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_attn_loss, fullgraph=True, backend=counter)
    kw = dict(h=16, hk=4, d=128, device="cuda", dtype=torch.bfloat16)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            inputs = _inputs(s=1000, **kw)
            # inductor generates its own reduction for the loss: equal up to summation order
            for a, b in zip(_grads(compiled, inputs), _grads(_attn_loss, inputs), strict=True):
                torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_attn_loss, fullgraph=True, backend=counter)
    for s in (513, 1024, 2047):
        inputs = _inputs(s=s, **kw)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 1)
        for a, b in zip(_grads(compiled, inputs), _grads(_attn_loss, inputs), strict=True):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_opcheck():
    inputs = _inputs(s=300, h=8, hk=2, d=64, device="cuda", dtype=torch.bfloat16)
    calls = _recorded_calls(lambda q, k, v: flashattn.flash_attn_func(q, k, v, causal=True), inputs)
    for func, args, kwargs in calls:
        torch.library.opcheck(func, *_no_double_backward(func, args, kwargs))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_cuda_graphs_reduce_overhead():
    # mode="reduce-overhead" replays CUDA graphs: the launches must be capturable (no host sync, no
    # allocation outside torch's allocator) and the replay must give the eager result
    m = MultiHeadAttention(256, 4, causal=True, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            # inductor fuses the projections' bias adds: equal up to bf16 rounding
            torch.testing.assert_close(compiled(x).clone(), m(x))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_inductor_backward_of_transposed_inputs():
    # the (b, h, s, d) -> (b, s, h, d) views that transformers and SDPA-style code hand over
    def fn(q, k, v):
        out = flashattn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return (out.transpose(1, 2) * torch.arange(out.shape[1], device=out.device).view(1, 1, -1, 1)).sum()

    kw = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    inputs = [torch.randn(2, 8, 300, 64, **kw) for _ in range(3)]
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    for a, b in zip(_grads(compiled, inputs), _grads(fn, inputs), strict=True):
        torch.testing.assert_close(a, b)
