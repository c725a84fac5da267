"""flashattn.modules and flashattn.rotary: against nn.MultiheadAttention, a float64 composition of the same
weights with the dense oracle, and per-sequence runs for padding. fp32 on the CPU (torch backend); the GPU
tests at the bottom run the Triton kernels in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from utils import assert_close_to_ref

import flashattn
from flashattn import config as flashattn_config
from flashattn import modules
from flashattn.modules import CrossAttention, MultiHeadAttention, SelfAttention, padded_attention
from flashattn.reference import attention_ref
from flashattn.rotary import RotaryEmbedding, apply_rotary_emb, rotary_cos_sin

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _torch_backend_off_gpu(request, monkeypatch):
    # the modules' logic is the same on every backend; CI runs with TRITON_INTERPRET=1, which would
    # otherwise interpret the kernels in every call (minutes). GPU tests keep the Triton kernels.
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(flashattn_config, "backend", "torch")


# -- rotary --------------------------------------------------------------------------------------------------


def _rotary_complex(x, rotary_dim, base, offset, interleaved):
    """RoPE as complex multiplication, in float64: an independent statement of the same rotation."""
    x = x.double()
    half = rotary_dim // 2
    f64 = dict(dtype=torch.float64, device=x.device)
    inv_freq = base ** (-torch.arange(half, **f64) * 2 / rotary_dim)
    pos = torch.arange(offset, offset + x.shape[1], **f64)
    rot = torch.polar(torch.ones(x.shape[1], half, **f64), torch.outer(pos, inv_freq))[:, None]
    if interleaved:
        z = torch.complex(x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]) * rot
        head = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        z = torch.complex(x[..., :half], x[..., half:rotary_dim]) * rot
        head = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((head, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [16, 10])
def test_rotary_matches_complex_rotation(rotary_dim, interleaved):
    x = torch.randn(2, 13, 3, 16)
    cos, sin = rotary_cos_sin(13, rotary_dim, base=500.0, offset=7)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved)
    expected = _rotary_complex(x, rotary_dim, 500.0, 7, interleaved)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    assert out.dtype == x.dtype


def test_rotary_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 6, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 6, 1, 8)
    qa, ka = rope(q, k)
    qb, kb = rope(q, k, seqlen_offset=100)
    sa = torch.einsum("bihd,bjhd->ij", qa, ka)
    sb = torch.einsum("bihd,bjhd->ij", qb, kb)
    torch.testing.assert_close(sa, sb, rtol=0, atol=1e-4)


def test_rotary_keeps_float32_angles_in_low_precision_modules():
    mha = MultiHeadAttention(32, 2, rotary_dim=16).to(torch.bfloat16)
    assert not list(mha.buffers()), "a buffer would be rounded to bf16 by .to()"


# -- nn.MultiheadAttention compatibility ---------------------------------------------------------------------


def _causal_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu(
        1
    )  # True = not allowed, nn.MultiheadAttention's convention


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_multihead_attention(causal, bias):
    torch.manual_seed(0)
    e, h, s = 48, 3, 29
    mha = nn.MultiheadAttention(e, h, bias=bias, batch_first=True)
    ours = MultiHeadAttention.from_torch(mha, causal=causal)
    ref = copy.deepcopy(mha).double()
    x = torch.randn(2, s, e, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    mask = _causal_mask(s) if causal else None

    out = ours(x)
    pt = mha(x, x, x, attn_mask=mask, need_weights=False)[0]
    oracle = ref(x64, x64, x64, attn_mask=mask, need_weights=False)[0]
    assert_close_to_ref(out, oracle, pt, name="out")

    dout = torch.randn_like(out)
    g_ours = torch.autograd.grad(out, [x, ours.Wqkv.weight, ours.out_proj.weight], dout)
    g_pt = torch.autograd.grad(pt, [x, mha.in_proj_weight, mha.out_proj.weight], dout)
    g_ref = torch.autograd.grad(oracle, [x64, ref.in_proj_weight, ref.out_proj.weight], dout.double())
    for name, a, r, p in zip(("dx", "dWqkv", "dWout"), g_ours, g_ref, g_pt, strict=True):
        assert_close_to_ref(a, r, p, factor=3.0, name=name)


def test_batch_first_false_module_maps_through_a_transpose():
    mha = nn.MultiheadAttention(32, 4)  # (seqlen, batch, embed) inputs
    ours = MultiHeadAttention.from_torch(mha)
    x = torch.randn(11, 2, 32)
    expected = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(ours(x.transpose(0, 1)).transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip():
    ours = MultiHeadAttention(32, 4, causal=True)
    sd = ours.torch_state_dict()
    assert set(sd) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    mha.load_state_dict(sd)
    back = MultiHeadAttention(32, 4)
    back.load_torch_state_dict(mha.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_from_torch_keeps_dtype_dropout_and_bias():
    mha = nn.MultiheadAttention(32, 4, bias=False, dropout=0.25, dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(mha)
    assert ours.Wqkv.weight.dtype == torch.float64 and ours.Wqkv.bias is None and ours.out_proj.bias is None
    assert ours.inner_attn.drop_p == 0.25


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: nn.MultiheadAttention(32, 4, add_bias_kv=True), "add_bias_kv"),
        (lambda: nn.MultiheadAttention(32, 4, kdim=16, vdim=16), "kdim"),
        (lambda: nn.MultiheadAttention(32, 4, add_zero_attn=True), "add_zero_attn"),
    ],
)
def test_from_torch_rejects_what_does_not_map(make, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention.from_torch(make())


def test_gqa_state_dict_does_not_map():
    with pytest.raises(ValueError, match="grouped-query"):
        MultiHeadAttention(32, 4, num_heads_kv=2).torch_state_dict()


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_heads_kv=4"):
        MultiHeadAttention(48, 6, num_heads_kv=4)
    with pytest.raises(ValueError, match="embed_dim=50"):
        MultiHeadAttention(50, 4)
    with pytest.raises(ValueError, match="rotary_dim=32"):
        MultiHeadAttention(32, 4, rotary_dim=32)


# -- MultiHeadAttention against a float64 composition of its own weights -------------------------------------


def _mha_oracle(m: MultiHeadAttention, x, *, upcast=True, attention_mask=None):
    """Wqkv -> split -> RoPE (complex form) -> dense attention -> out_proj, from m's weights."""
    dt = torch.float64 if upcast else x.dtype
    w = {k: v.to(dt) for k, v in m.state_dict().items()}
    x = x.to(dt)
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    qkv = F.linear(x, w["Wqkv.weight"], w.get("Wqkv.bias"))
    q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
    q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))
    if m.rotary_emb is not None:
        r = m.rotary_emb
        q = _rotary_complex(q, r.dim, r.base, 0, r.interleaved).to(dt)
        k = _rotary_complex(k, r.dim, r.base, 0, r.interleaved).to(dt)
    a = m.inner_attn
    out, _ = attention_ref(
        q, k, v, causal=a.causal, softmax_scale=a.softmax_scale, window_size=a.window_size, upcast=upcast,
        query_padding_mask=attention_mask, key_padding_mask=attention_mask,
    )  # fmt: skip
    if attention_mask is not None:
        out = out.masked_fill(~attention_mask[:, :, None, None], 0.0)
    return F.linear(out.flatten(-2).to(dt), w["out_proj.weight"], w.get("out_proj.bias"))


def _check_against_oracle(m, x, attention_mask=None):
    out = m(x, attention_mask)
    oracle = _mha_oracle(m, x, attention_mask=attention_mask)
    pt = _mha_oracle(m, x, upcast=False, attention_mask=attention_mask)
    assert_close_to_ref(out, oracle, pt)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_heads_kv=2),
        dict(num_heads_kv=1, causal=True),
        dict(rotary_dim=12, causal=True),
        dict(num_heads_kv=2, rotary_dim=24, rotary_interleaved=True, softmax_scale=0.3),
    ],
    ids=["gqa", "mqa-causal", "rotary-partial", "gqa-rotary-interleaved-scale"],
)
def test_mha_matches_oracle(kwargs):
    m = MultiHeadAttention(96, 4, **kwargs)
    _check_against_oracle(m, torch.randn(2, 37, 96))


def test_mha_sliding_window_matches_oracle():
    m = MultiHeadAttention(64, 4, num_heads_kv=2, causal=True, window_size=(5, 0))
    _check_against_oracle(m, torch.randn(2, 33, 64))


def test_mha_padding_mask_matches_oracle_and_per_sequence_runs():
    m = MultiHeadAttention(64, 4, num_heads_kv=2, causal=True, rotary_dim=16)
    x = torch.randn(3, 20, 64)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, 13:] = False  # right padding
    mask[2, :6] = False  # left padding
    out = m(x, mask)
    # right padding: the oracle's padding masks align on the real lengths
    oracle = _mha_oracle(m, x[:2], attention_mask=mask[:2])
    pt = _mha_oracle(m, x[:2], upcast=False, attention_mask=mask[:2])
    assert_close_to_ref(out[:2], oracle, pt)
    # left padding: the same as the sequence run alone (RoPE is relative, so the shift does not matter)
    torch.testing.assert_close(out[2, 6:], m(x[2:, 6:])[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[2, :6], m.out_proj.bias.expand(6, -1), rtol=0, atol=0)


def test_mha_dropout_in_training_only():
    m = MultiHeadAttention(32, 4, dropout=0.5, causal=True)
    x = torch.randn(2, 16, 32, requires_grad=True)
    m.eval()
    evaluated = m(x)
    torch.testing.assert_close(m(x), evaluated, rtol=0, atol=0)
    m.train()
    torch.manual_seed(3)
    a = m(x)
    torch.manual_seed(3)
    b = m(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same seed, the same mask
    assert not torch.allclose(a, evaluated)
    a.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_eval_mode_passes_no_dropout(monkeypatch):
    seen = []

    def spy(q, k, v, **kwargs):
        seen.append(kwargs["dropout_p"])
        return flashattn.flash_attn_func(q, k, v, **{**kwargs, "dropout_p": 0.0})

    monkeypatch.setattr(modules, "flash_attn_func", spy)
    m = MultiHeadAttention(32, 4, dropout=0.5)
    x = torch.randn(1, 5, 32)
    m.eval()(x)
    m.train()(x)
    assert seen == [0.0, 0.5]


# -- inner attention modules and padding helpers -------------------------------------------------------------


def test_self_and_cross_attention_match_flash_attn_func():
    qkv = torch.randn(2, 19, 3, 4, 16)
    q, k, v = qkv.unbind(2)
    expected = flashattn.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(SelfAttention(causal=True)(qkv), expected, rtol=0, atol=0)
    torch.testing.assert_close(SelfAttention()(qkv, causal=True), expected, rtol=0, atol=0)
    kv = torch.randn(2, 23, 2, 2, 16)
    got = CrossAttention(softmax_scale=0.2)(q, kv)
    torch.testing.assert_close(got, flashattn.flash_attn_func(q, *kv.unbind(2), softmax_scale=0.2))


def test_varlen_modules_match_per_sequence_calls():
    lengths, lengths_k = [7, 1, 12], [9, 4, 12]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    qkv = torch.randn(sum(lengths), 3, 4, 16)
    out = SelfAttention(causal=True)(qkv, cu_seqlens=cu, max_seqlen=max(lengths))
    q = torch.randn(sum(lengths), 4, 16)
    kv = torch.randn(sum(lengths_k), 2, 2, 16)
    out_x = CrossAttention(causal=True)(
        q, kv, cu_seqlens=cu, max_seqlen=12, cu_seqlens_k=cu_k, max_seqlen_k=12
    )
    for i in range(3):
        a, b = cu[i].item(), cu[i + 1].item()
        ak, bk = cu_k[i].item(), cu_k[i + 1].item()
        s = qkv[a:b].unsqueeze(0).unbind(2)
        torch.testing.assert_close(out[a:b], flashattn.flash_attn_func(*s, causal=True)[0])
        one = flashattn.flash_attn_func(q[None, a:b], *kv[None, ak:bk].unbind(2), causal=True)[0]
        torch.testing.assert_close(out_x[a:b], one)


def test_padded_attention_matches_oracle_with_gradients():
    torch.manual_seed(1)
    q, k, v = (torch.randn(3, 17, 4, 16, requires_grad=True) for _ in range(3))
    kmask = torch.ones(3, 17, dtype=torch.bool)
    kmask[0, 10:] = False
    kmask[2, 3:] = False
    out = padded_attention(q, k, v, kmask, causal=True)
    args64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    masks = dict(query_padding_mask=kmask, key_padding_mask=kmask, causal=True)
    oracle = attention_ref(*args64, **masks)[0].masked_fill(~kmask[:, :, None, None], 0)
    pt = attention_ref(q, k, v, upcast=False, **masks)[0].masked_fill(~kmask[:, :, None, None], 0)
    assert_close_to_ref(out, oracle, pt)
    dout = torch.randn_like(out)
    for name, a, r, p in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(oracle, args64, dout.double()),
        torch.autograd.grad(pt, (q, k, v), dout),
        strict=True,
    ):
        assert_close_to_ref(a, r, p, factor=3.0, name=f"d{name}")


def test_padded_attention_without_real_keys_gives_zeros():
    q, k, v = (torch.randn(2, 5, 2, 8) for _ in range(3))
    kmask = torch.ones(2, 5, dtype=torch.bool)
    kmask[1] = False
    out = padded_attention(q, k, v, kmask, query_padding_mask=torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0], flashattn.flash_attn_func(q[:1], k[:1], v[:1])[0])


# -- GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_torch_multihead_attention(dtype):
    torch.manual_seed(0)
    e, h, s = 512, 8, 1000
    mha = nn.MultiheadAttention(e, h, batch_first=True, device="cuda")
    ref = copy.deepcopy(mha).double()
    mha = mha.to(dtype)
    ours = MultiHeadAttention.from_torch(mha, causal=True)
    x = torch.randn(2, s, e, device="cuda")
    mask = _causal_mask(s).cuda()
    out = ours(x.to(dtype))
    pt = mha(x.to(dtype), x.to(dtype), x.to(dtype), attn_mask=mask, need_weights=False)[0]
    x64 = x.double()
    oracle = ref(x64, x64, x64, attn_mask=mask, need_weights=False)[0]
    assert_close_to_ref(out, oracle, pt)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_gqa_rotary_padding_matches_oracle():
    torch.manual_seed(0)
    m = MultiHeadAttention(
        256, 8, num_heads_kv=2, causal=True, rotary_dim=32, device="cuda", dtype=torch.bfloat16
    )
    x = torch.randn(3, 300, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(3, 300, dtype=torch.bool, device="cuda")
    mask[1, 211:] = False
    out = m(x, mask)
    oracle = _mha_oracle(m, x, attention_mask=mask)
    pt = _mha_oracle(m, x, upcast=False, attention_mask=mask)
    assert_close_to_ref(out, oracle, pt)
