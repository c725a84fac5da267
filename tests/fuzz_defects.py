"""Random invalid calls (one defect each: a type, a shape, a range, an index, a device-side value) of every
public function, for tests/fuzz_run.py: each must raise FlashAttnError (the newer ones: with a message that
names the argument, Call.detail["names"]). Calls whose device indices are out of range, unchecked
(check_inputs=False), which must run and equal the call with the clamped indices. And cu_seqlens the checks
would reject, handed straight to the Triton launchers, which must stay inside their tensors."""

from __future__ import annotations

import math

import torch
from fuzz_cases import Call, Draw, _heads, _tensor
from fuzz_cases_decode import cache_lens, page_pool

import flashattn
from flashattn import config, fp8
from flashattn import flash_attn_interface as fai
from flashattn.layers.rotary import apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_


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


# defects in cu_seqlens' or max_seqlen's values, which only a device-to-host copy can see: read in host
# memory always, on a device under config.check_varlen (else handed to the kernels unchecked)
VARLEN_VALUE_DEFECTS = frozenset({"cu decreasing", "cu first not 0", "cu past the tokens",
                                  "max_seqlen below the longest", "max_seqlen_k below the longest",
                                  "qkvpacked cu"})


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
        "private leftpad_k": lambda: fai._flash_attn_varlen_forward(
            q, k, v, cu, cu, 6, 6, 0.0, 0.25, False, leftpad_k=torch.tensor(d.pick([[0, 1, 0], [4, 0, 0],
                                                                                   [0, 0, -2]]), **i32)),
    }
    del lens
    name = d.pick(sorted(defects))
    if name not in VARLEN_VALUE_DEFECTS:
        return Call("varlen", defects[name], invalid=name)
    checked = env.device == "cpu" or d.chance(0.5)  # host values are always read; device ones on request

    def run():
        with config.use_check_varlen(checked):
            return defects[name]()
    if checked:
        return Call("varlen", run, invalid=name)
    # unchecked device values reach the kernels, which clamp every row into the packed tensors: the results
    # are not specified, the check is memcheck's (the GPU sample), so any result passes here
    return Call("varlen-unchecked", run, check=lambda result: None, detail={"unchecked": name})


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


def _pick(d: Draw, kind: str, defects: dict) -> Call:
    """One of defects: name -> (the call, a word its message must contain: the argument's name)."""
    name = d.pick(sorted(defects))
    run, names = defects[name]
    return Call(kind, run, invalid=name, detail={"names": names})


def _paged_defect(d: Draw, env) -> Call:
    """flash_attn_with_kvcache on a page pool (8 pages of 16 in use, one spare; capacity 64): a bad block
    table (type, shape, strides), a bad pool, and with check_inputs=True (or the config's check_indices)
    device values out of range (cache_seqlens past the capacity or negative, a used page past the pool)."""
    q = _tensor(d, (2, 1, 4, 16), env.dtypes[0], env.device)
    kp, vp = (_tensor(d, (9, 16, 2, 16), q.dtype, env.device) for _ in range(2))
    table = torch.randperm(9, generator=torch.Generator().manual_seed(d.int(0, 999)))[:8].view(2, 4).to(
        torch.int32).to(env.device)
    new = _tensor(d, (2, 1, 2, 16), q.dtype, env.device)
    i32, dev = dict(dtype=torch.int32, device=env.device), dict(device=env.device)
    lens = torch.tensor([20, 5], **i32)  # sequence 0 uses pages 0 and 1
    kv = flashattn.flash_attn_with_kvcache

    def call(checked=True, **kw):
        args = dict(cache_seqlens=lens, block_table=table)
        args.update(kw)
        return lambda: kv(q, args.pop("k_cache", kp), args.pop("v_cache", vp), check_inputs=checked or None,
                          **args)

    def bad_entry(value, row=0, col=1):
        t = table.clone()
        t[row, col] = value
        return t

    def under_config(**kw):
        def run():
            with config.use_check_indices(True):
                return kv(q, kp, vp, cache_seqlens=lens, **kw)
        return run

    far = d.pick([9, 10**6, 2**31 - 1])
    defects = {
        "block_table int64": (call(block_table=table.long()), "block_table"),
        "block_table float": (call(block_table=table.float()), "block_table"),
        "block_table 1-D": (call(block_table=table[0]), "block_table"),
        "block_table batch": (call(block_table=table[:1]), "block_table"),
        "block_table strided": (call(block_table=torch.stack([table, table], -1)[..., 0]), "block_table"),
        "block_table a list": (call(block_table=table.tolist()), "block_table"),
        "block_table with cache_batch_idx": (call(cache_batch_idx=torch.tensor([0, 1], **i32)),
                                             "cache_batch_idx"),
        "page_size 20": (call(k_cache=kp.new_zeros(7, 20, 2, 16), v_cache=vp.new_zeros(7, 20, 2, 16)),
                         "page_size"),
        "v_cache pages": (call(v_cache=vp.new_zeros(4, 32, 2, 16)), "v_cache"),
        "key_padding_mask capacity": (call(key_padding_mask=torch.ones(2, 63, dtype=torch.bool, **dev)),
                                      "key_padding_mask"),
        "int seqlens over": (call(False, cache_seqlens=d.pick([64, 65, 2**31 - 1]), k=new, v=new),
                             "cache_seqlens"),
        # device values: checked on request
        "seqlens past the capacity": (call(cache_seqlens=torch.tensor([3, d.pick([65, 2**31 - 1])], **i32)),
                                      "cache_seqlens"),
        "seqlens negative": (call(cache_seqlens=torch.tensor([d.pick([-1, -(2**31)]), 3], **i32)),
                             "cache_seqlens"),
        "append past the capacity": (call(cache_seqlens=torch.tensor([64, 0], **i32), k=new, v=new),
                                     "cache_seqlens"),
        "page past the pool": (call(block_table=bad_entry(far)), "block_table"),
        "page negative": (call(block_table=bad_entry(d.pick([-1, -(2**31)]))), "block_table"),
        "appended page past the pool": (call(block_table=bad_entry(far), k=new, v=new,
                                             cache_seqlens=torch.tensor([16, 5], **i32)), "block_table"),
        "page past the pool, config": (under_config(block_table=bad_entry(far, 1, 0)), "block_table"),
    }
    return _pick(d, "kvcache-paged", defects)


def unchecked_paged_call(d: Draw, env) -> Call:
    """A paged flash_attn_with_kvcache call whose cache_seqlens / block_table values are out of range,
    unchecked (check_inputs=False): the kernels clamp every index (cache_seqlens into [0, capacity -
    seqlen_new], pages into [0, num_pages)), so it must run without touching memory out of bounds (the
    interpreter would crash or read garbage) and give the call with those clamped values, bit for bit."""
    b, sq = d.int(1, 2), d.pick([1, 2])
    h, hk = _heads(d, env, b)
    dtype = d.pick(env.dtypes)
    page = d.pick([16, 32])
    max_pages = d.int(1, 3)
    cap = page * max_pages
    kc, vc, table = page_pool(d, env, b, hk, 16, dtype, page, max_pages)
    s_new = d.pick([0, 1, 2])
    lens = cache_lens(d, b, cap - s_new)
    bad_lens = list(lens)
    bad_table = table.clone()
    n_pages = kc.shape[0]
    for _ in range(d.int(1, 3)):
        if d.chance(0.4):
            bad_lens[d.int(0, b - 1)] = d.pick([-1, -5, -(2**31), cap - s_new + 1, cap, 10**6, 2**31 - 1])
        else:
            bad_table[d.int(0, b - 1), d.int(0, max_pages - 1)] = d.pick(
                [-1, -7, -(2**31), n_pages, n_pages + 5, 10**6, 2**31 - 1])
    clamped_lens = [min(max(n, 0), cap - s_new) for n in bad_lens]
    clamped_table = bad_table.clamp(0, n_pages - 1)
    i32 = dict(dtype=torch.int32, device=env.device)
    q = _tensor(d, (b, sq, h, 16), dtype, env.device)
    kn = vn = None
    if s_new:
        kn, vn = (_tensor(d, (b, s_new, hk, 16), dtype, env.device) for _ in range(2))
    causal = d.chance(0.5)
    before = (kc.clone(), vc.clone())

    def call(caches, seqlens, block_table):
        return flashattn.flash_attn_with_kvcache(
            q, *caches, kn, vn, cache_seqlens=torch.tensor(seqlens, **i32), block_table=block_table,
            causal=causal, return_softmax_lse=True, check_inputs=False)

    def run():
        return call((kc, vc), bad_lens, bad_table)

    def check(res):
        out, lse = res
        assert out.shape == q.shape and lse.shape == (b, h, sq)
        caches = [t.clone() for t in before]
        want, want_lse = call(caches, clamped_lens, clamped_table)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), (
            f"unchecked out-of-range indices (seqlens {bad_lens}, table {bad_table.tolist()}) do not give "
            f"the call with the clamped ones (seqlens {clamped_lens}, table {clamped_table.tolist()})")
        assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1]), "the pools after a clamped append"

    return Call("kvcache-paged-unchecked", run, check)


def _plan_defect(d: Draw, env) -> Call:
    """DecodePlan: bad constructor arguments, and runs whose tensors do not fit the plan."""
    base = dict(batch=2, nheads=4, nheads_k=2, headdim=16, page_size=16, max_seqlen_k=64, dtype=torch.float32,
                device=env.device)

    def plan(**kw):
        return lambda: flashattn.DecodePlan(**dict(base, **kw))

    q = _tensor(d, (2, 1, 4, 16), torch.float32, env.device)
    kp, vp, table = page_pool(d, env, 2, 2, 16, torch.float32, 16, 4)
    lens = torch.tensor([9, 30], dtype=torch.int32, device=env.device)

    def run(**kw):
        args = dict(q=q, k_cache=kp, v_cache=vp, cache_seqlens=lens, block_table=table)
        args.update(kw)
        return lambda: flashattn.DecodePlan(**base).run(
            args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"),
            args.pop("block_table"), **args)

    defects = {
        "batch 0": (plan(batch=0), "batch"),
        "batch bool": (plan(batch=True), "batch"),
        "batch float": (plan(batch=2.0), "batch"),
        "nheads 0": (plan(nheads=0), "nheads"),
        "nheads_k 0": (plan(nheads_k=0), "nheads_k"),
        "gqa": (plan(nheads=6, nheads_k=4), "nheads"),
        "headdim 0": (plan(headdim=0), "headdim"),
        "headdim 300": (plan(headdim=300), "headdim"),
        "page_size 20": (plan(page_size=20), "page_size"),
        "page_size 0": (plan(page_size=0), "page_size"),
        "page_size str": (plan(page_size="16"), "page_size"),
        "max_seqlen_k 0": (plan(max_seqlen_k=0), "max_seqlen_k"),
        "max_seqlen_k float": (plan(max_seqlen_k=64.0), "max_seqlen_k"),
        "seqlen_q 0": (plan(seqlen_q=0), "seqlen_q"),
        "dtype float64": (plan(dtype=torch.float64), "dtype"),
        "dtype int32": (plan(dtype=torch.int32), "dtype"),
        "cache_dtype": (plan(cache_dtype=torch.float16), "cache_dtype"),
        "softmax_scale 0": (plan(softmax_scale=0.0), "softmax_scale"),
        "softmax_scale nan": (plan(softmax_scale=math.nan), "softmax_scale"),
        "softcap < 0": (plan(softcap=-1.0), "softcap"),
        "window float": (plan(window_size=(2.5, 0)), "window_size"),
        "window triple": (plan(window_size=(1, 2, 3)), "window_size"),
        "num_splits -1": (plan(num_splits=-1), "num_splits"),
        "num_splits float": (plan(num_splits=1.5), "num_splits"),
        "run q shape": (run(q=q[:1]), "q"),
        "run q dtype": (run(q=q.half()), "q"),
        "run no block_table": (run(block_table=None), "block_table"),
        "run page_size": (run(k_cache=kp.new_zeros(5, 32, 2, 16), v_cache=vp.new_zeros(5, 32, 2, 16)),
                          "page_size"),
        "run cache heads": (run(k_cache=kp[:, :, :1], v_cache=vp[:, :, :1]), "k_cache"),
        "run cache dtype": (run(k_cache=kp.half(), v_cache=vp.half()), "k_cache"),
        "run k without v": (run(k=q[:, :, :2]), "k"),
    }
    return _pick(d, "decode-plan", defects)


def _fp8_defect(d: Draw, env) -> Call:
    """FP8 flash_attn_func / flash_attn_varlen_func: descales of a wrong shape, dtype or type, out_dtype,
    dropout, gradients, a 16-bit tensor among the e4m3 ones, a v neither last- nor seqlen-contiguous."""
    q8, k8, v8 = (_tensor(d, s, torch.float32, env.device).to(fp8.FP8)
                  for s in ((2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)))
    qd, kd, vd = (torch.ones(2, n, device=env.device) for n in (4, 2, 2))

    def f(**kw):
        args = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
        args.update(kw)
        return lambda: flashattn.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    def needs_grad():
        leaf = q8.clone().requires_grad_(True)
        return flashattn.flash_attn_func(leaf, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)

    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32, device=env.device)
    dev = dict(device=env.device)

    def varlen(**kw):
        args = dict(q_descale=torch.ones(3, 4, **dev), k_descale=torch.ones(3, 2, **dev),
                    v_descale=torch.ones(1, **dev))
        args.update(kw)
        return lambda: flashattn.flash_attn_varlen_func(q8.flatten(0, 1), k8.flatten(0, 1), v8.flatten(0, 1),
                                                        cu, cu, 8, 8, **args)

    bf16 = torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16, device=env.device)
    defects = {
        "k bfloat16": (f(k=bf16), "float8_e4m3fn"),
        "16-bit with descales": (f(q=bf16.repeat(1, 1, 2, 1), k=bf16, v=bf16), "float8_e4m3fn"),
        "dropout": (f(dropout_p=0.1), "dropout_p"),
        "gradients": (needs_grad, "grad"),
        "k_descale (2, 4)": (f(k_descale=torch.ones(2, 4, **dev)), "k_descale"),
        "k_descale (2,)": (f(k_descale=torch.ones(2, **dev)), "k_descale"),
        "q_descale (3, 4)": (f(q_descale=torch.ones(3, 4, **dev)), "q_descale"),
        "q_descale (2, 3)": (f(q_descale=torch.ones(2, 3, **dev)), "q_descale"),
        "q_descale (1, 1)": (f(q_descale=torch.ones(1, 1, **dev)), "q_descale"),
        "v_descale (2, 2, 1)": (f(v_descale=torch.ones(2, 2, 1, **dev)), "v_descale"),
        "v_descale float64": (f(v_descale=torch.ones(1, dtype=torch.float64, **dev)), "v_descale"),
        "v_descale float16": (f(v_descale=torch.ones(1, dtype=torch.float16, **dev)), "v_descale"),
        "k_descale int32": (f(k_descale=torch.ones(1, dtype=torch.int32, **dev)), "k_descale"),
        "v_descale a float": (f(v_descale=2.0), "v_descale"),
        "q_descale a list": (f(q_descale=[1.0]), "q_descale"),
        "out_dtype e4m3": (f(out_dtype=torch.float8_e4m3fn), "out_dtype"),
        "out_dtype int32": (f(out_dtype=torch.int32), "out_dtype"),
        "out_dtype str": (f(out_dtype="float16"), "out_dtype"),
        "v strided": (f(v=torch.zeros(2, 2, 8, 32, **dev).to(fp8.FP8)[..., ::2].permute(0, 2, 1, 3)), "v"),
        "varlen q_descale batch": (varlen(q_descale=torch.ones(2, 4, **dev)), "q_descale"),
        "varlen k_descale heads": (varlen(k_descale=torch.ones(3, 4, **dev)), "k_descale"),
        "varlen v_descale f64": (varlen(v_descale=torch.ones(1, dtype=torch.float64, **dev)), "v_descale"),
    }
    return _pick(d, "fp8", defects)


def _rotary_packed_defect(d: Draw, env) -> Call:
    """apply_rotary_emb_qkv_ / apply_rotary_emb_kv_: a packed tensor of the wrong layout, num_heads_q missing
    or inconsistent, tables or offsets that do not fit."""
    dtype = env.dtypes[0]
    qkv = _tensor(d, (2, 10, 3, 2, 16), dtype, env.device)
    gqa = _tensor(d, (2, 10, 8, 16), dtype, env.device)  # 4 q heads + 2 * 2 kv heads
    kv = _tensor(d, (2, 10, 2, 2, 16), dtype, env.device)
    cos = torch.ones(12, 8, device=env.device)
    qkv_, kv_ = apply_rotary_emb_qkv_, apply_rotary_emb_kv_
    defects = {
        "qkv 3-D": (lambda: qkv_(qkv[:, :, 0, 0], cos, cos), "qkv"),
        "qkv 4 parts": (lambda: qkv_(torch.cat([qkv, qkv[:, :, :1]], 2), cos, cos), "qkv"),
        "qkv a list": (lambda: qkv_(qkv.tolist(), cos, cos), "qkv"),
        "num_heads_q missing": (lambda: qkv_(gqa, cos, cos), "num_heads_q"),
        "num_heads_q odd kv heads": (lambda: qkv_(gqa, cos, cos, num_heads_q=d.pick([3, 5])), "num_heads_q"),
        "num_heads_q all": (lambda: qkv_(gqa, cos, cos, num_heads_q=8), "num_heads_q"),
        "num_heads_q 0": (lambda: qkv_(gqa, cos, cos, num_heads_q=0), "num_heads_q"),
        "num_heads_q bool": (lambda: qkv_(gqa, cos, cos, num_heads_q=True), "num_heads_q"),
        "num_heads_q float": (lambda: qkv_(gqa, cos, cos, num_heads_q=4.0), "num_heads_q"),
        "kv 3 parts": (lambda: kv_(qkv, cos, cos), "kv"),
        "kv 4-D": (lambda: kv_(kv[:, :, 0], cos, cos), "kv"),
        "offset past the table": (lambda: qkv_(qkv, cos, cos, seqlen_offsets=3), "seqlen_offsets"),
        "offset negative": (lambda: kv_(kv, cos, cos, seqlen_offsets=-1), "seqlen_offsets"),
        "offsets shape": (lambda: qkv_(qkv, cos, cos, seqlen_offsets=torch.zeros(3, dtype=torch.int32,
                                                                                 device=env.device)),
                          "seqlen_offsets"),
        "offsets float": (lambda: kv_(kv, cos, cos, seqlen_offsets=torch.zeros(2, device=env.device)),
                          "seqlen_offsets"),
        "sin shape": (lambda: qkv_(qkv, cos, cos[:, :4]), "sin"),
        "sin_k shape": (lambda: qkv_(qkv, cos, cos, cos, cos[:5]), "sin"),
        "rotary_dim past headdim": (lambda: kv_(kv, torch.ones(12, 9, device=env.device),
                                                torch.ones(12, 9, device=env.device)), "rotary_dim"),
        "cos int": (lambda: qkv_(qkv, cos.int(), cos), "cos"),
    }
    return _pick(d, "rotary-packed", defects)


def _varlen_backward_defect(d: Draw, env) -> Call:
    """_flash_attn_varlen_backward with gradients buffers, an LSE, dout or rng_state that do not fit."""
    q, k, v, out = (_tensor(d, (9, 2, 16), torch.float32, env.device) for _ in range(4))
    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32, device=env.device)
    lse = torch.zeros(2, 9, device=env.device)  # the forward's shapes (values never read: each call raises)
    rng = torch.zeros(2, dtype=torch.int64, device=env.device)

    def bwd(**kw):
        args = dict(dout=out, lse=lse, dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v),
                    p=0.0, rng=rng)
        args.update(kw)
        return lambda: fai._flash_attn_varlen_backward(
            args["dout"], q, k, v, out, args["lse"], args["dq"], args["dk"], args["dv"], cu, cu, 6, 6,
            args["p"], 0.25, False, -1, -1, 0.0, None, False, args["rng"])

    defects = {
        "dq shape": (bwd(dq=q[:5]), "dq"),
        "dk dtype": (bwd(dk=k.half()), "dk"),
        "dv a list": (bwd(dv=v.tolist()), "dv"),
        "lse shape": (bwd(lse=lse[:, :5]), "softmax_lse"),
        "lse float16": (bwd(lse=lse.half()), "softmax_lse"),
        "dout shape": (bwd(dout=out[:4]), "dout"),
        "dropout without rng_state": (bwd(p=0.2, rng=None), "rng_state"),
    }
    return _pick(d, "varlen-private-backward", defects)


INVALID = [_dense_defect, _varlen_defect, _other_defect, _paged_defect, _plan_defect, _fp8_defect,
           _rotary_packed_defect, _varlen_backward_defect]
# valid calls with out-of-range device indices left unchecked: drawn among the valid ones
UNCHECKED = [unchecked_paged_call]


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
