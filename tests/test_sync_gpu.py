"""No host-device synchronisation in the default path of any public function: each call runs under
torch.cuda.set_sync_debug_mode("error"), which turns every synchronising CUDA call torch makes (a
device-to-host copy, .item(), nonzero, a synchronous memcpy) into an error. Each function is called once
before, outside the mode: a first call compiles kernels and fills caches, which may read the device.

The functions that still synchronise, and why, are listed in STILL_SYNC: the test asserts that they do, so
the list stays true (a function that stops synchronising fails here until it moves to SYNC_FREE).

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


def _dense_fwd_bwd():
    q, k, v = _t(B, 77, H, D, grad=True), _t(B, 77, HK, D, grad=True), _t(B, 77, HK, D, grad=True)
    out = flashattn.flash_attn_func(q, k, v, causal=True)
    out.backward(torch.ones_like(out))


def _dense_options():
    q, k, v = _t(B, 77, H, D, grad=True), _t(B, 60, HK, D, grad=True), _t(B, 60, HK, D, grad=True)
    out = flashattn.flash_attn_func(q, k, v, dropout_p=0.1, window_size=(16, 4), softcap=5.0,
                                    alibi_slopes=torch.rand(H, device="cuda"))
    out.backward(torch.ones_like(out))


def _packed():
    qkv = _t(B, 50, 3, H, D, grad=True)
    flashattn.flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    q, kv = _t(B, 50, H, D, grad=True), _t(B, 40, 2, HK, D, grad=True)
    flashattn.flash_attn_kvpacked_func(q, kv).sum().backward()


def _varlen():
    cu = _i32(0, 30, 30, 77)
    q, k, v = _t(77, H, D, grad=True), _t(77, HK, D, grad=True), _t(77, HK, D, grad=True)
    flashattn.flash_attn_varlen_func(q, k, v, cu, cu, 47, 47, causal=True).sum().backward()


def _varlen_paged():
    kc, vc, table = _paged_cache()
    cu_q, cu_k = _i32(0, 5, 12), _i32(0, 100, 120)
    q = _t(12, H, D)
    flashattn.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 7, 100, causal=True, block_table=table)


def _kvcache_decode():
    kc, vc = _t(B, 512, HK, D), _t(B, 512, HK, D)
    flashattn.flash_attn_with_kvcache(_t(B, 1, H, D), kc, vc, cache_seqlens=_i32(100, 511))


def _kvcache_paged_append_rotary():
    kc, vc, table = _paged_cache()
    cos, sin = torch.rand(128, D // 2, **BF), torch.rand(128, D // 2, **BF)
    flashattn.flash_attn_with_kvcache(_t(B, 2, H, D), kc, vc, _t(B, 2, HK, D), _t(B, 2, HK, D), cos, sin,
                                      cache_seqlens=_i32(3, 100), block_table=table, causal=True,
                                      num_splits=3)


def _kvcache_every_index():
    kc, vc = _t(4, 256, HK, D), _t(4, 256, HK, D)
    flashattn.flash_attn_with_kvcache(
        _t(B, 1, H, D), kc, vc, _t(B, 1, HK, D), _t(B, 1, HK, D), cache_seqlens=_i32(40, 200),
        cache_batch_idx=_i32(3, 1), cache_leftpad=_i32(5, 0), alibi_slopes=torch.rand(H, device="cuda"),
        window_size=(64, 0), softcap=10.0, key_padding_mask=torch.rand(B, 256, device="cuda") > 0.2,
        return_softmax_lse=True)


def _kvcache_int_seqlens():
    kc, vc = _t(B, 256, HK, D), _t(B, 256, HK, D)
    flashattn.flash_attn_with_kvcache(_t(B, 1, H, D), kc, vc, _t(B, 1, HK, D), _t(B, 1, HK, D),
                                      cache_seqlens=77)


_PLAN = {}


def _decode_plan():
    if "plan" not in _PLAN:
        _PLAN["plan"] = flashattn.DecodePlan(B, H, HK, D, page_size=16, max_seqlen_k=128, causal=True)
        _PLAN["cache"] = _paged_cache()
    kc, vc, table = _PLAN["cache"]
    _PLAN["plan"].run(_t(B, 1, H, D), kc, vc, _i32(7, 90), table, k=_t(B, 1, HK, D), v=_t(B, 1, HK, D))


def _plan_and_replan():
    plan = flashattn.DecodePlan(B, H, HK, D, max_seqlen_k=4096).replan(max_seqlen_k=256)
    kc, vc = _t(B, 256, HK, D), _t(B, 256, HK, D)
    plan.run(_t(B, 1, H, D), kc, vc, _i32(1, 255))


_MASKS = {}


def _block_sparse():
    # building a mask reads it on the host (once per pattern); the call itself must not
    if "mask" not in _MASKS:
        _MASKS["mask"] = flashattn.BlockMask.local_global(256, 64, 16, block_size=(64, 64), device="cuda")
    q, k, v = _t(1, 256, H, D, grad=True), _t(1, 256, HK, D, grad=True), _t(1, 256, HK, D, grad=True)
    flashattn.block_sparse_attn_func(q, k, v, _MASKS["mask"]).sum().backward()


def _merge():
    outs = [_t(B, 3, H, D) for _ in range(3)]
    lses = [torch.randn(B, H, 3, device="cuda") for _ in range(3)]
    flashattn.merge_attention_states(outs, lses)
    flashattn.merge_attention_states(outs[0], lses[0], outs[1], lses[1])


def _modules():
    x = _t(B, 40, 256)
    if "mha" not in _MASKS:  # built once: initialising the weights is not the call under test
        _MASKS["mha"] = modules.MultiHeadAttention(256, 8, num_heads_kv=2, causal=True, rotary_dim=32, **BF)
    mha = _MASKS["mha"]
    mask = torch.ones(B, 40, dtype=torch.bool, device="cuda")
    mask[1, 30:] = False
    mha(x).sum().backward()
    mha(x, mask).sum().backward()
    modules.SelfAttention(causal=True)(_t(B, 40, 3, H, D))
    modules.CrossAttention()(_t(B, 40, H, D), _t(B, 50, 2, HK, D))


def _padded_attention_and_static_unpad():
    mask = torch.rand(B, 40, device="cuda") > 0.3
    q, k, v = _t(B, 40, H, D, grad=True), _t(B, 40, HK, D, grad=True), _t(B, 40, HK, D, grad=True)
    modules.padded_attention(q, k, v, mask, causal=True).sum().backward()
    bert_padding.unpad_indices_static(mask)


class _Module(torch.nn.Module):
    is_causal = True


def _transformers_attention():
    # the function and the mask builder transformers calls: prefill with a padding mask, decode steps with
    # and without one (a dynamic cache's keys, a static cache's whole length)
    module = _Module()
    user_mask = torch.ones(B, 30, dtype=torch.long, device="cuda")
    user_mask[0, :4] = 0  # left padding
    prefill = fa_hf.padding_mask(B, 30, 30, attention_mask=user_mask)
    fa_hf.attention_forward(module, _t(B, H, 30, D), _t(B, HK, 30, D), _t(B, HK, 30, D), prefill,
                            scaling=D**-0.5)
    step = fa_hf.padding_mask(B, 1, 31, attention_mask=torch.cat((user_mask, user_mask[:, :1]), 1))
    fa_hf.attention_forward(module, _t(B, H, 1, D), _t(B, HK, 31, D), _t(B, HK, 31, D), step, scaling=0.1)
    static = fa_hf.padding_mask(B, 1, 64, attention_mask=torch.cat((user_mask, user_mask[:, :1]), 1))
    fa_hf.attention_forward(module, _t(B, H, 1, D), _t(B, HK, 64, D), _t(B, HK, 64, D), static, scaling=0.1)
    fa_hf.attention_forward(module, _t(B, H, 1, D), _t(B, HK, 31, D), _t(B, HK, 31, D), None, scaling=0.1)
    fa_hf.attention_forward(module, _t(B, H, 30, D), _t(B, HK, 30, D), _t(B, HK, 30, D), None)


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
    "DecodePlan + replan + run": _plan_and_replan,
    "block_sparse_attn_func": _block_sparse,
    "merge_attention_states": _merge,
    "modules": _modules,
    "padded_attention, unpad_indices_static": _padded_attention_and_static_unpad,
    "transformers attention_forward, padding_mask": _transformers_attention,
}


def _unpad_input():
    bert_padding.unpad_input(_t(B, 40, 16), torch.rand(B, 40, device="cuda") > 0.3)


def _kvcache_checked():
    kc, vc = _t(B, 256, HK, D), _t(B, 256, HK, D)
    flashattn.flash_attn_with_kvcache(_t(B, 1, H, D), kc, vc, cache_seqlens=_i32(3, 4), check_inputs=True)


def _transformers_packed_sequences():
    pos = torch.cat((torch.arange(10), torch.arange(20))).view(1, -1).cuda()
    fa_hf.attention_forward(_Module(), _t(1, H, 30, D), _t(1, HK, 30, D), _t(1, HK, 30, D), None,
                            position_ids=pos)


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
    fn = SYNC_FREE[name]
    fn()  # compiles, fills the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(STILL_SYNC))
def test_known_syncs(name):
    fn = STILL_SYNC[name]
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
