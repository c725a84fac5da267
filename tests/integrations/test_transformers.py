"""flashattn as a Hugging Face transformers attention implementation: small random-weight models built with
from_config (no downloads), compared with attn_implementation="sdpa" under the tolerance rule.

The rule needs an oracle: the same weights run through sdpa in float64. Our error against it may be at most
twice sdpa's own float32 (GPU: bfloat16) error. Only real (non-padded) positions are compared: at padded query
positions sdpa returns whatever its masked softmax gives, flash implementations return 0.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from utils import assert_close_to_ref

transformers = pytest.importorskip("transformers")

import flashattn.integrations.transformers as fa_hf  # noqa: E402
from flashattn import config as flashattn_config  # noqa: E402
from flashattn import kvcache  # noqa: E402
from flashattn.integrations.transformers import register  # noqa: E402
from flashattn.kvcache import flash_attn_with_kvcache  # noqa: E402

NAME = register()
HAS_CUDA = torch.cuda.is_available()
VOCAB = 96


@pytest.fixture(autouse=True)
def _torch_backend_off_gpu(request, monkeypatch):
    # the integration's logic is the same on every backend; CI runs with TRITON_INTERPRET=1, which would
    # otherwise interpret the kernels in every call (minutes). GPU tests keep the Triton kernels.
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(flashattn_config, "backend", "torch")


_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def _config(arch: str, **overrides):
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **_SMALL)
    elif arch == "mistral":
        # the default sliding_window (4096) is longer than every test sequence: the window flag stays off
        cfg = transformers.MistralConfig(vocab_size=VOCAB, num_key_value_heads=1, **_SMALL)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, **_SMALL)
    elif arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _models(arch: str, dtype=torch.float32, device="cpu", **overrides):
    """(ours, sdpa, sdpa in float64) with identical weights, in eval mode."""
    cfg = _config(arch, **overrides)
    torch.manual_seed(0)
    # each model gets its own config: from_config records attn_implementation on the object it is given
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    sdpa.load_state_dict(ours.state_dict())
    ref = copy.deepcopy(sdpa).to(device=device, dtype=torch.float64)
    return ours.to(device, dtype).eval(), sdpa.to(device, dtype).eval(), ref.eval()


def _batch(padding: str, b=3, s=21, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.long)
    lengths = [s, s - 5, s - 11][:b]
    for i, n in enumerate(lengths):
        if padding == "left":
            mask[i, : s - n] = 0
        elif padding == "right":
            mask[i, n:] = 0
    return ids.to(device), mask.to(device)


def _logits(model, ids, mask, padding):
    with torch.no_grad():
        return model(ids, attention_mask=None if padding == "none" else mask).logits


ARCHS = ["llama", "mistral", "qwen2", "gpt2"]


def test_register_returns_name_and_rejects_flash_names():
    assert register() == NAME == "fa_triton"
    assert register("fa_triton_custom") == "fa_triton_custom"
    assert "fa_triton_custom" in transformers.AttentionInterface()
    assert "fa_triton_custom" in transformers.AttentionMaskInterface()
    with pytest.raises(ValueError, match="flash"):
        register("my_flash_attn")


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_sdpa(arch, padding):
    ours, sdpa, ref = _models(arch)
    ids, mask = _batch(padding)
    real = mask.bool() if padding != "none" else torch.ones_like(mask, dtype=torch.bool)
    out, pt, oracle = (_logits(m, ids, mask, padding)[real] for m in (ours, sdpa, ref))
    assert_close_to_ref(out, oracle, pt, name=f"{arch} logits, {padding} padding")


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_sdpa(arch):
    ours, sdpa, _ = _models(arch)
    ids, mask = _batch("left", s=12)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(ids, **kwargs)
        b = sdpa.generate(ids, **kwargs)
    assert torch.equal(a, b), f"greedy tokens differ:\nours {a[:, 12:].tolist()}\nsdpa {b[:, 12:].tolist()}"


def test_gradients_match_sdpa():
    ours, sdpa, ref = _models("llama")
    ids, mask = _batch("right")
    grads = []
    for model in (ours, sdpa, ref):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        assert_close_to_ref(grads[0][n], grads[2][n], grads[1][n], factor=3.0, name=f"grad {n}")


def test_packed_sequences_match_sdpa():
    # one row holding three sequences, told apart by position_ids restarting at 0 (no padding mask): both
    # implementations must keep the sequences from attending to each other
    ours, sdpa, ref = _models("llama")
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in (9, 5, 10)]).unsqueeze(0)
    with torch.no_grad():
        # without a cache: transformers' mask builders detect packing only then
        out, pt, oracle = (m(ids, position_ids=pos, use_cache=False).logits for m in (ours, sdpa, ref))
        alone = ours(ids[:, 9:14], position_ids=pos[:, 9:14], use_cache=False).logits
    assert_close_to_ref(out, oracle, pt, name="packed logits")
    torch.testing.assert_close(out[:, 9:14], alone, rtol=0, atol=1e-5)


def test_prepared_4d_mask_falls_back_to_sdpa(caplog):
    ours, sdpa, _ = _models("llama")
    ids, _ = _batch("none", b=2, s=10)
    keep = torch.ones(10, 10, dtype=torch.bool).tril()
    keep[:, :2] = True  # a prefix every query sees: not a pattern the kernel flags can express
    mask4d = keep.expand(2, 1, 10, 10)
    fa_hf._warned.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="flashattn.integrations.transformers"):
        out = ours(ids, attention_mask=mask4d).logits
        expected = sdpa(ids, attention_mask=mask4d).logits
    torch.testing.assert_close(out, expected)
    assert any("4-D attention mask" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize(
    "arch, padding, overrides",
    [("llama", "left", {}), ("llama", "right", {}), ("qwen2", "none", {}),
     ("mistral", "left", {"sliding_window": 6})],
    ids=["llama-left", "llama-right", "qwen2", "mistral-window-left"],
)
def test_output_attentions_matches_eager(arch, padding, overrides, caplog):
    # output_attentions=True with a padding mask: the weights are formed (eager) under the integration's own
    # mask, the 2-D padding mask and the module's causal / window flags; logits and weights as eager's
    cfg = _config(arch, **overrides)
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(ours.state_dict())
    eager.eval()
    ref = copy.deepcopy(eager).double()
    ids, mask = _batch(padding)
    real = mask.bool()
    fa_hf._warned.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="flashattn.integrations.transformers"):
        outs = [m(ids, attention_mask=mask, output_attentions=True) for m in (ours, eager, ref)]
    assert any("output_attentions" in r.getMessage() for r in caplog.records), caplog.text
    logits = [o.logits[real] for o in outs]
    assert_close_to_ref(*logits, name=f"{arch} logits")
    assert len(outs[0].attentions) == cfg.num_hidden_layers
    for layer, weights in enumerate(zip(*(o.attentions for o in outs), strict=True)):
        assert weights[0].shape == weights[1].shape
        # the real query rows (a padded query's row is the implementation's choice)
        rows = [w.transpose(1, 2)[real] for w in weights]  # (real queries, h, sk)
        assert_close_to_ref(rows[0], rows[2], rows[1], name=f"{arch} layer {layer} attention weights")


def test_sliding_window_matches_sdpa():
    ours, sdpa, ref = _models("mistral", sliding_window=6)
    ids, mask = _batch("none")
    out, pt, oracle = (_logits(m, ids, mask, "none") for m in (ours, sdpa, ref))
    assert_close_to_ref(out, oracle, pt, name="mistral sliding-window logits")


def test_gpt_oss_sinks_and_sliding_window_match_eager():
    # attention sinks (s_aux -> learnable_sink) on alternating sliding-window / full layers; gpt-oss has no
    # sdpa path, so eager is both the low-precision yardstick and (in float64) the oracle
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
    )  # fmt: skip
    cfg._experts_implementation = "eager"  # the grouped-GEMM experts have no float64 kernel
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.load_state_dict(ours.state_dict())
    eager.eval()
    ref = copy.deepcopy(eager).double()
    with torch.no_grad():
        for module in ours.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()  # the init leaves them tiny; give them weight
        eager.load_state_dict(ours.state_dict())
        ref.load_state_dict(ours.state_dict())
    ids, mask = _batch("left")
    real = mask.bool()
    out, pt, oracle = (_logits(m, ids, mask, "left")[real] for m in (ours, eager, ref))
    assert_close_to_ref(out, oracle, pt, name="gpt-oss logits")


# -- GPU: the Triton kernels in bfloat16 ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_bf16_logits_match_sdpa(arch, padding):
    ours, sdpa, ref = _models(arch, torch.bfloat16, "cuda")
    ids, mask = _batch(padding, s=77, device="cuda")
    real = mask.bool() if padding != "none" else torch.ones_like(mask, dtype=torch.bool)
    out, pt, oracle = (_logits(m, ids, mask, padding)[real] for m in (ours, sdpa, ref))
    assert_close_to_ref(out, oracle, pt, name=f"{arch} bf16 logits, {padding} padding")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_bf16_generate_agrees_with_sdpa(arch):
    # in bfloat16 an exact tie-break cannot be demanded; instead every token we pick must be sdpa's argmax
    # up to sdpa's own bf16 error on that step (teacher-forced on our sequence)
    ours, sdpa, ref = _models(arch, torch.bfloat16, "cuda")
    ids, mask = _batch("left", s=16, device="cuda")
    with torch.no_grad():
        seq = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        full = torch.cat([mask, mask.new_ones(mask.shape[0], seq.shape[1] - ids.shape[1])], dim=1)
        pt = sdpa(seq, attention_mask=full).logits[:, ids.shape[1] - 1 : -1].double()
        oracle = ref(seq, attention_mask=full).logits[:, ids.shape[1] - 1 : -1]
    slack = 4 * (pt - oracle).abs().max().item()
    chosen = pt.gather(-1, seq[:, ids.shape[1] :, None]).squeeze(-1)
    assert (chosen >= pt.max(-1).values - slack).all(), "a generated token is not sdpa's greedy choice"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_decode_steps_take_the_kvcache_kernel(cache, monkeypatch):
    # every generated token after the first runs each layer's attention through flash_attn_with_kvcache's
    # prepared launch, the left padding as its key_padding_mask; with a static cache the mask spans the whole
    # cache (fixed shapes, one preparation); a dynamic cache grows by a key a step, and each step's first
    # layer resizes the launch of the step before (one preparation in all, then one resize a step)
    calls, prepared, resized = [], [], []
    launch_call, resize = kvcache.Launch.__call__, kvcache.Launch.resized
    prepare_launch = kvcache.prepare_launch

    def spy_call(self, q, k_cache, *args):
        key_mask = args[10]
        calls.append((k_cache.shape[1], None if key_mask is None else key_mask.shape[1]))
        return launch_call(self, q, k_cache, *args)

    monkeypatch.setattr(kvcache.Launch, "__call__", spy_call)
    monkeypatch.setattr(kvcache, "prepare_launch",
                        lambda *a, **k: prepared.append(1) or prepare_launch(*a, **k))
    monkeypatch.setattr(kvcache.Launch, "resized", lambda *a: resized.append(1) or resize(*a))
    fa_hf._steps.clear()
    fa_hf._families.clear()
    ours, sdpa, _ = _models("llama")
    ids, mask = _batch("left", s=12)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        a = ours.generate(ids, **kwargs)
        b = sdpa.generate(ids, **kwargs)
    assert torch.equal(a, b), f"greedy tokens differ:\nours {a[:, 12:].tolist()}\nsdpa {b[:, 12:].tolist()}"
    layers = ours.config.num_hidden_layers
    assert len(calls) == 3 * layers  # the first new token comes from the prefill
    lengths = [keys for keys, _ in calls]
    if cache == "dynamic":
        assert lengths == [n for n in (13, 14, 15) for _ in range(layers)]
        assert (len(prepared), len(resized)) == (1, 2)
    else:
        assert len(set(lengths)) == 1 and lengths[0] >= 15  # the whole cache, at every step
        assert (len(prepared), len(resized)) == (1, 0)
    assert all(mask_len == keys for keys, mask_len in calls)


def _decode_steps_against_kvcache(masked: bool, device: str, dtype: torch.dtype) -> list:
    # the integration's decode path (a launch kept per signature and resized as the cache grows, taking
    # transformers' tensors untransposed where the launch reads only addresses) computes what
    # flash_attn_with_kvcache computes on the transposed views, bit for bit, at every length; a mask shorter
    # than the cache (a static cache's written slots) limits the keys. Returns the launches kept.
    fa_hf._steps.clear()
    fa_hf._families.clear()
    module = torch.nn.Module()
    module.is_causal = True
    b, h, hk, d = 2, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    for length, slots in ((30, 30), (31, 31), (32, 36), (33, 33), (65, 65), (17, 17)):
        q = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
        k, v = (torch.randn(b, hk, slots, d, generator=gen).to(device, dtype) for _ in range(2))
        mask = None
        if masked or slots > length:
            mask = (torch.rand(b, length, generator=gen) > 0.3).to(device)
            mask[:, -1] = True
        out, weights = fa_hf.attention_forward(module, q, k, v, mask, scaling=0.125)
        want = flash_attn_with_kvcache(q.transpose(1, 2), k[:, :, :length].transpose(1, 2),
                                       v[:, :, :length].transpose(1, 2), softmax_scale=0.125, causal=True,
                                       key_padding_mask=mask)
        assert weights is None and torch.equal(out, want), f"length {length}"
    assert len(fa_hf._steps) == 6
    return list(fa_hf._steps.values())


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_steps_equal_flash_attn_with_kvcache(backend_name, masked, monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", backend_name)
    _decode_steps_against_kvcache(masked, "cpu", torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_decode_steps_equal_flash_attn_with_kvcache(masked):
    launches = _decode_steps_against_kvcache(masked, "cuda", torch.bfloat16)
    assert all(launch.prepared.addresses_only for launch in launches)  # the untransposed tensors' path


def test_mask_builder_reads_no_value():
    # no `.all()` shortcut (a device sync): an all-real mask is returned as a mask; a decode step's mask
    # shorter than the cache is padded with False to the cache's length
    mask = torch.ones(2, 7, dtype=torch.long)
    assert torch.equal(fa_hf.padding_mask(2, 7, 7, attention_mask=mask), mask.bool())
    step = fa_hf.padding_mask(2, 1, 10, attention_mask=mask)
    assert step.shape == (2, 10) and step[:, :7].all() and not step[:, 7:].any()
    assert fa_hf.padding_mask(2, 1, 10, attention_mask=None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_static_cache_cuda_graphs_agree_with_sdpa():
    # transformers' compiled decoding (torch.compile mode="reduce-overhead": CUDA graphs) over a static cache:
    # the decode step's mask spans the whole cache, so its shapes stay fixed from token to token; every token
    # must be sdpa's greedy choice up to sdpa's own bf16 error on that step (teacher-forced)
    from transformers import CompileConfig

    ours, sdpa, ref = _models("llama", torch.bfloat16, "cuda")
    ids, mask = _batch("left", s=16, device="cuda")
    kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                  cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"))
    with torch.no_grad():
        seq = ours.generate(ids, **kwargs)
        again = ours.generate(ids, **kwargs)  # replays the captured graphs
        full = torch.cat([mask, mask.new_ones(mask.shape[0], seq.shape[1] - ids.shape[1])], dim=1)
        pt = sdpa(seq, attention_mask=full).logits[:, ids.shape[1] - 1 : -1].double()
        oracle = ref(seq, attention_mask=full).logits[:, ids.shape[1] - 1 : -1]
    assert torch.equal(seq, again)
    slack = 4 * (pt - oracle).abs().max().item()
    chosen = pt.gather(-1, seq[:, ids.shape[1] :, None]).squeeze(-1)
    assert (chosen >= pt.max(-1).values - slack).all(), "a generated token is not sdpa's greedy choice"
