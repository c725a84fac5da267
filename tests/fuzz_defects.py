"""Random invalid calls (one defect each: a type, a shape, a range, an index, a device-side value) of every
public function, for tests/fuzz_run.py: each must raise FlashAttnError. And cu_seqlens the checks would
reject, handed straight to the Triton launchers, which must stay inside their tensors."""

from __future__ import annotations

import math

import torch
from fuzz_cases import Call, Draw, _tensor

import flashattn
from flashattn import flash_attn_interface as fai
from flashattn.layers.rotary import apply_rotary_emb


def _qkv(d, env, b=2, sq=9, sk=11, h=2, hk=1, hd=16, dtype=None):
    dtype = dtype or env.dtypes[0]
    return [_tensor(d, s, dtype, env.device) for s in ((b, sq, h, hd), (b, sk, hk, hd), (b, sk, hk, hd))]


def _dense_defect(d: Draw, env) -> Call:
    q, k, v = _qkv(d, env)
    f = flashattn.flash_attn_func
    defects = {
        "q float64": lambda: f(q.double(), k, v),
        "q int32": lambda: f(q.to(torch.int32), k, v),
        "q 3-D": lambda: f(q[0], k, v),
        "q a list": lambda: f(q.tolist(), k, v),
        "k headdim": lambda: f(q, k[..., :8], v),
        "heads not a multiple": lambda: f(q, *(_tensor(d, (2, 11, 3, 16), q.dtype, env.device)
                                               for _ in "kv")),
        "headdim 300": lambda: f(*(_tensor(d, (1, 3, 1, 300), q.dtype, env.device) for _ in "qkv")),
        "batch": lambda: f(q, k[:1], v[:1]),
        "v seqlen": lambda: f(q, k, v[:, :5]),
        "dtype mix": lambda: f(q, k.float() if k.dtype != torch.float32 else k.half(), v),
        "last dim strided": lambda: f(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v),
        "nheads 0": lambda: f(q[:, :, :0], k[:, :, :0], v[:, :, :0]),
        "dropout_p 1": lambda: f(q, k, v, dropout_p=1.0),
        "dropout_p str": lambda: f(q, k, v, dropout_p="0.1"),
        "softcap < 0": lambda: f(q, k, v, softcap=-1.0),
        "scale 0": lambda: f(q, k, v, softmax_scale=0.0),
        "scale nan": lambda: f(q, k, v, softmax_scale=math.nan),
        "window float": lambda: f(q, k, v, window_size=(1.5, 2)),
        "window triple": lambda: f(q, k, v, window_size=(1, 2, 3)),
        "window float tensor": lambda: f(q, k, v, window_size=torch.tensor([1.0, 2.0])),
        "alibi shape": lambda: f(q, k, v, alibi_slopes=torch.rand(3, device=env.device)),
        "alibi float64": lambda: f(q, k, v, alibi_slopes=torch.rand(2, device=env.device).double()),
        "sink shape": lambda: f(q, k, v, learnable_sink=torch.rand(5, device=env.device)),
        "qkvpacked 2 parts": lambda: flashattn.flash_attn_qkvpacked_func(torch.stack([q, q], 2)),
        "kvpacked 3 parts": lambda: flashattn.flash_attn_kvpacked_func(q, torch.stack([k, k, k], 2)),
    }
    name = d.pick(sorted(defects))
    return Call("dense", defects[name], invalid=name)


def _varlen_defect(d: Draw, env) -> Call:
    lens = [3, 0, 6]
    q, k, v = (_tensor(d, (9, 2, 16), env.dtypes[0], env.device) for _ in range(3))
    i32 = dict(dtype=torch.int32, device=env.device)
    cu = torch.tensor([0, 3, 3, 9], **i32)
    f = flashattn.flash_attn_varlen_func
    defects = {
        "cu int64": lambda: f(q, k, v, cu.long(), cu, 6, 6),
        "cu 2-D": lambda: f(q, k, v, cu.view(1, -1), cu, 6, 6),
        "cu empty": lambda: f(q, k, v, cu[:0], cu[:0], 6, 6),
        "cu batch mismatch": lambda: f(q, k, v, cu, cu[:3], 6, 6),
        "cu decreasing": lambda: f(q, k, v, torch.tensor([0, 5, 3, 9], **i32), cu, 6, 6),
        "cu first not 0": lambda: f(q, k, v, cu + d.pick([1, -1]), cu, 6, 6),
        "cu past the tokens": lambda: f(q, k, v, cu, torch.tensor([0, 3, 3, d.pick([10, 2**31 - 1])], **i32),
                                        6, 6),
        "cu strided": lambda: f(q, k, v, torch.tensor([0, 0, 3, 0, 3, 0, 9, 0], **i32)[::2], cu, 6, 6),
        "max_seqlen below the longest": lambda: f(q, k, v, cu, cu, d.pick([0, 5]), 6),
        "max_seqlen_k below the longest": lambda: f(q, k, v, cu, cu, 6, 2),
        "max_seqlen negative": lambda: f(q, k, v, cu, cu, -1, 6),
        "max_seqlen float": lambda: f(q, k, v, cu, cu, 6.0, 6),
        "q 4-D": lambda: f(q.unsqueeze(0), k, v, cu, cu, 6, 6),
        "qkvpacked cu": lambda: flashattn.flash_attn_varlen_qkvpacked_func(
            torch.stack([q, k, v], 1), torch.tensor([0, 4, 2, 9], **i32), 6),
        "private num_splits": lambda: fai._flash_attn_varlen_forward(q, k, v, cu, cu, 6, 6, 0.0, 0.25, False,
                                                                     num_splits=2),
        "private seqused_k": lambda: fai._flash_attn_varlen_forward(
            q, k, v, cu, cu, 6, 6, 0.0, 0.25, False, seqused_k=torch.tensor([4, 0, 6], **i32)),
    }
    del lens
    name = d.pick(sorted(defects))
    return Call("varlen", defects[name], invalid=name)


def _other_defect(d: Draw, env) -> Call:
    q, k, v = _qkv(d, env, sq=1)
    kc = _tensor(d, (2, 16, 1, 16), q.dtype, env.device)
    vc = kc.clone()
    i32 = dict(dtype=torch.int32, device=env.device)
    lse = torch.zeros(2, 2, 1, device=env.device)
    out = torch.zeros_like(q)
    cos = torch.ones(8, 4, device=env.device)
    kv = flashattn.flash_attn_with_kvcache
    defects = {
        # device values are checked on request (check_inputs); unchecked, the kernels clamp them
        "kvcache seqlens past the cache": lambda: kv(q, kc, vc, cache_seqlens=torch.tensor([3, 17], **i32),
                                                     check_inputs=True),
        "kvcache seqlens negative": lambda: kv(q, kc, vc, cache_seqlens=torch.tensor([-1, 2], **i32),
                                               check_inputs=True),
        "kvcache append past the cache": lambda: kv(q, kc, vc, k[:, :1], v[:, :1], cache_seqlens=16),
        "kvcache k without v": lambda: kv(q, kc, vc, k[:, :1], None, cache_seqlens=3),
        "kvcache dtype": lambda: kv(q, kc.double(), vc.double()),
        "kvcache batch_idx": lambda: kv(q, kc, vc, cache_batch_idx=torch.tensor([0, 2], **i32),
                                        check_inputs=True),
        "sparse lengths": lambda: flashattn.block_sparse_attn_func(
            q, k, v, flashattn.BlockMask.causal(5, 11, block_size=16, device=env.device)),
        "sparse not a mask": lambda: flashattn.block_sparse_attn_func(q, k, v, None),
        "merge lse shape": lambda: flashattn.merge_attention_states(out, lse[:, :1], out, lse),
        "merge lse float64": lambda: flashattn.merge_attention_states(out, lse.double(), out, lse.double()),
        "merge nothing": lambda: flashattn.merge_attention_states([], []),
        "rotary offset past the table": lambda: apply_rotary_emb(q, cos, cos, seqlen_offsets=8),
        "rotary dim past headdim": lambda: apply_rotary_emb(q, torch.ones(8, 9, device=env.device),
                                                            torch.ones(8, 9, device=env.device)),
        "private backward lse": lambda: fai._flash_attn_backward(out, q, k, v, out, lse[:, :, :0], None, None,
                                                                 None, 0.0, 0.25, False, -1, -1, 0.0, None,
                                                                 False),
        "private backward dq": lambda: fai._flash_attn_backward(out, q, k, v, out, lse, k, None, None, 0.0,
                                                                0.25, False, -1, -1, 0.0, None, False),
    }
    name = d.pick(sorted(defects))
    return Call("other", defects[name], invalid=name)


INVALID = [_dense_defect, _varlen_defect, _other_defect]


# cu_seqlens the checks would reject, handed straight to the Triton launchers (as unchecked CUDA values
# reach them): past the tokens, negative, decreasing, extreme, longer than max_seqlen; 20 tokens,
# max_seqlen 16
BAD_CU_SEQLENS = ([0, 10, 1_000_000], [0, -50, 20], [5, 3, 2**31 - 1], [-(2**31), 0, 40])


def launch_with_bad_cu_seqlens(cu, device, dtype) -> None:
    """The Triton launchers (forward, backward, S_dmask) with unchecked cu_seqlens: the kernels clamp every
    row into the packed tensors, so this must finish without touching memory out of bounds (the results are
    not specified)."""
    from flashattn.backends.triton import attention, probs

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 2, 16, generator=gen).to(device, dtype) for _ in range(3))
    c = torch.tensor(cu, dtype=torch.int32, device=device)
    kw = dict(softmax_scale=0.25, causal=True, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=16,
              max_seqlen_k=16)
    out, lse = attention.attention_forward(q, k, v, **kw)
    attention.attention_backward(torch.ones_like(out), q, k, v, out, lse, **kw)
    probs.attention_probs(q, k, dropout_p=0.3, rng_seed=1, rng_offset=0, block_n=64, **kw)
