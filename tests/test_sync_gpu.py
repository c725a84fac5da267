"""No host-device synchronisation in the default path of any public function: each call runs under
torch.cuda.set_sync_debug_mode("error"), which turns every synchronising CUDA call torch makes (a
device-to-host copy, .item(), nonzero, a synchronous memcpy) into an error. Each function is called once
before, outside the mode: a first call compiles kernels and fills caches, which may read the device.

Each case is a setup, run outside the mode (building inputs from host lists copies them to the device, which
synchronises), that returns the call under test. The functions that still synchronise, and why, are listed
in STILL_SYNC: the test asserts that they do, so the list stays true (a function that stops synchronising
fails here until it moves to SYNC_FREE).

    PYTHONPATH=src pytest -m gpu tests/test_sync_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import flashattn
from flashattn import bert_padding, modules
from flashattn.integrations import transformers as fa_hf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF = dict(device="cuda", dtype=torch.bfloat16)
B, H, HK, D = 2, 8, 2, 64


def _t(*shape, grad=False):
    return torch.randn(*shape, **BF).requires_grad_(grad)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _paged_cache(page=16, pages=8):
    kc, vc = _t(B * pages + 2, page, HK, D), _t(B * pages + 2, page, HK, D)
    table = torch.randperm(B * pages + 2, device="cuda")[: B * pages].view(B, pages).to(torch.int32)
    return kc, vc, table


def _backward(out):
    return out.backward(torch.ones_like(out))


def _dense_fwd_bwd():
    q, k, v = _t(B, 77, H, D, grad=True), _t(B, 77, HK, D, grad=True), _t(B, 77, HK, D, grad=True)
    return lambda: _backward(flashattn.flash_attn_func(q, k, v, causal=True))


def _dense_options():
    q, k, v = _t(B, 77, H, D, grad=True), _t(B, 60, HK, D, grad=True), _t(B, 60, HK, D, grad=True)
    slopes = torch.rand(H, device="cuda")
    opts = dict(dropout_p=0.1, window_size=(16, 4), softcap=5.0, alibi_slopes=slopes)
    return lambda: _backward(flashattn.flash_attn_func(q, k, v, **opts))


def _packed():
    qkv, q, kv = _t(B, 50, 3, H, D, grad=True), _t(B, 50, H, D, grad=True), _t(B, 40, 2, HK, D, grad=True)

    def call():
        _backward(flashattn.flash_attn_qkvpacked_func(qkv, causal=True))
        _backward(flashattn.flash_attn_kvpacked_func(q, kv))
    return call


def _varlen():
    cu = _i32(0, 30, 30, 77)
    q, k, v = _t(77, H, D, grad=True), _t(77, HK, D, grad=True), _t(77, HK, D, grad=True)
    return lambda: _backward(flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 47, 47, causal=True))


def _varlen_paged():
    kc, vc, table = _paged_cache()
    cu_q, cu_k, q = _i32(0, 5, 12), _i32(0, 100, 120), _t(12, H, D)
    return lambda: flashattn.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 7, 100, causal=True,
                                                    block_table=table)


def _kvcache_decode():
    kc, vc, q, seqlens = _t(B, 512, HK, D), _t(B, 512, HK, D), _t(B, 1, H, D), _i32(100, 511)
    return lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)


def _kvcache_paged_append_rotary():
    kc, vc, table = _paged_cache()
    cos, sin = torch.rand(128, D // 2, **BF), torch.rand(128, D // 2, **BF)
    q, kn, vn, seqlens = _t(B, 2, H, D), _t(B, 2, HK, D), _t(B, 2, HK, D), _i32(3, 100)
    return lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cos, sin, cache_seqlens=seqlens,
                                                     block_table=table, causal=True, num_splits=3)


def _kvcache_every_index():
    kc, vc, q, kn, vn = _t(4, 256, HK, D), _t(4, 256, HK, D), _t(B, 1, H, D), _t(B, 1, HK, D), _t(B, 1, HK, D)
    args = dict(cache_seqlens=_i32(40, 200), cache_batch_idx=_i32(3, 1), cache_leftpad=_i32(5, 0),
                alibi_slopes=torch.rand(H, device="cuda"),
                key_padding_mask=torch.rand(B, 256, device="cuda") > 0.2)
    return lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, window_size=(64, 0), softcap=10.0,
                                                     return_softmax_lse=True, **args)


def _kvcache_int_seqlens():
    kc, vc, q, kn, vn = _t(B, 256, HK, D), _t(B, 256, HK, D), _t(B, 1, H, D), _t(B, 1, HK, D), _t(B, 1, HK, D)
    return lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=77)


def _decode_plan():
    plan = flashattn.DecodePlan(B, H, HK, D, page_size=16, max_seqlen_k=128, causal=True)
    kc, vc, table = _paged_cache()
    q, kn, vn, seqlens = _t(B, 1, H, D), _t(B, 1, HK, D), _t(B, 1, HK, D), _i32(7, 90)
    return lambda: plan.run(q, kc, vc, seqlens, table, k=kn, v=vn)


def _plan_and_replan():
    plan = flashattn.DecodePlan(B, H, HK, D, max_seqlen_k=4096)
    kc, vc, q, seqlens = _t(B, 256, HK, D), _t(B, 256, HK, D), _t(B, 1, H, D), _i32(1, 255)
    return lambda: plan.replan(max_seqlen_k=256).run(q, kc, vc, seqlens)


def _block_sparse():
    # building a mask reads it on the host (once per pattern, in the setup); the call itself must not
    mask = flashattn.BlockMask.local_global(256, 64, 16, block_size=(64, 64), device="cuda")
    q, k, v = _t(1, 256, H, D, grad=True), _t(1, 256, HK, D, grad=True), _t(1, 256, HK, D, grad=True)
    return lambda: _backward(flashattn.block_sparse_attn_func(q, k, v, mask))


def _merge():
    outs = [_t(B, 3, H, D) for _ in range(3)]
    lses = [torch.randn(B, H, 3, device="cuda") for _ in range(3)]

    def call():
        flashattn.merge_attention_states(outs, lses)
        flashattn.merge_attention_states(outs[0], lses[0], outs[1], lses[1])
    return call


def _modules():
    x, qkv, q, kv = _t(B, 40, 256), _t(B, 40, 3, H, D), _t(B, 40, H, D), _t(B, 50, 2, HK, D)
    mha = modules.MultiHeadAttention(256, 8, num_heads_kv=2, causal=True, rotary_dim=32, **BF)
    mask = torch.ones(B, 40, dtype=torch.bool, device="cuda")
    mask[1, 30:] = False

    def call():
        _backward(mha(x))
        _backward(mha(x, mask))
        modules.SelfAttention(causal=True)(qkv)
        modules.CrossAttention()(q, kv)
    return call


def _padded_attention_and_static_unpad():
    mask = torch.rand(B, 40, device="cuda") > 0.3
    q, k, v = _t(B, 40, H, D, grad=True), _t(B, 40, HK, D, grad=True), _t(B, 40, HK, D, grad=True)

    def call():
        _backward(modules.padded_attention(q, k, v, mask, causal=True))
        bert_padding.unpad_indices_static(mask)
    return call


class _Module(torch.nn.Module):
    is_causal = True


def _transformers_attention():
    # the function and the mask builder transformers calls: prefill with a padding mask, decode steps with
    # and without one (a dynamic cache's keys, a static cache's whole length), a mask-free prefill
    module = _Module()
    user_mask = torch.ones(B, 31, dtype=torch.long, device="cuda")
    user_mask[0, :4] = 0  # left padding
    prefill_qkv = _t(B, H, 30, D), _t(B, HK, 30, D), _t(B, HK, 30, D)
    step_qkv = _t(B, H, 1, D), _t(B, HK, 31, D), _t(B, HK, 31, D)
    static_qkv = _t(B, H, 1, D), _t(B, HK, 64, D), _t(B, HK, 64, D)

    def call():
        prefill = fa_hf.padding_mask(B, 30, 30, attention_mask=user_mask[:, :30])
        fa_hf.attention_forward(module, *prefill_qkv, prefill, scaling=D**-0.5)
        step = fa_hf.padding_mask(B, 1, 31, attention_mask=user_mask)
        fa_hf.attention_forward(module, *step_qkv, step, scaling=0.1)
        static = fa_hf.padding_mask(B, 1, 64, attention_mask=user_mask)
        fa_hf.attention_forward(module, *static_qkv, static, scaling=0.1)
        fa_hf.attention_forward(module, *step_qkv, None, scaling=0.1)
        fa_hf.attention_forward(module, *prefill_qkv, None)
    return call


SYNC_FREE = {
    "flash_attn_func fwd+bwd": _dense_fwd_bwd,
    "flash_attn_func dropout window softcap alibi": _dense_options,
    "flash_attn_qkvpacked_func / kvpacked": _packed,
    "flash_attn_varlen_func": _varlen,
    "flash_attn_varlen_func block_table": _varlen_paged,
    "flash_attn_with_kvcache decode": _kvcache_decode,
    "flash_attn_with_kvcache paged append rotary splits": _kvcache_paged_append_rotary,
    "flash_attn_with_kvcache every index and option": _kvcache_every_index,
    "flash_attn_with_kvcache int cache_seqlens": _kvcache_int_seqlens,
    "DecodePlan.run": _decode_plan,
    "DecodePlan.replan + run": _plan_and_replan,
    "block_sparse_attn_func": _block_sparse,
    "merge_attention_states": _merge,
    "modules": _modules,
    "padded_attention, unpad_indices_static": _padded_attention_and_static_unpad,
    "transformers attention_forward, padding_mask": _transformers_attention,
}


def _unpad_input():
    x, mask = _t(B, 40, 16), torch.rand(B, 40, device="cuda") > 0.3
    return lambda: bert_padding.unpad_input(x, mask)


def _kvcache_checked():
    kc, vc, q, seqlens = _t(B, 256, HK, D), _t(B, 256, HK, D), _t(B, 1, H, D), _i32(3, 4)
    return lambda: flashattn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, check_inputs=True)


def _transformers_packed_sequences():
    pos = torch.cat((torch.arange(10), torch.arange(20))).view(1, -1).cuda()
    qkv = _t(1, H, 30, D), _t(1, HK, 30, D), _t(1, HK, 30, D)
    return lambda: fa_hf.attention_forward(_Module(), *qkv, None, position_ids=pos)


STILL_SYNC = {
    # its API returns max_seqlen_in_batch as an int and a tensor sized by the mask (flash_attn's)
    "bert_padding.unpad_input": _unpad_input,
    # the opt-in range checks read the indices on the host, by design
    "flash_attn_with_kvcache(check_inputs=True)": _kvcache_checked,
    # mask-free calls whose position_ids restart (packed sequences): the number of sequences sizes
    # cu_seqlens
    "transformers attention_forward, packed position_ids": _transformers_packed_sequences,
}


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_no_sync(name):
    call = SYNC_FREE[name]()
    call()  # compiles, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(STILL_SYNC))
def test_known_syncs(name):
    call = STILL_SYNC[name]()
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
