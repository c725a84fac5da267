"""Compile every kernel variant the public API reaches for sm_90a, on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which never compiles them: a kernel can pass every
interpreter test and still fail in Triton's GPU lowering (layouts, shared-memory budget, ptxas). This script
swaps Triton's driver for one that reports an H200 (sm_90, warp 32), turns every launch into a warm-up
(compile, do not run), and calls the public functions on CPU tensors with the H200 tile table, so the whole
TTIR -> TTGIR -> LLVM -> PTX -> cubin pipeline runs here, for free, before any device time is spent.

    python scripts/sm90_compile_check.py [dense] [decode] [sparse] [--quick]

prints a line per case and exits 1 if any failed; --quick: the bf16 subset tests/test_sm90_compile.py runs.
"""

import os
import sys
import time
from functools import partial

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _H200Driver:
    """What JITFunction.run asks of a driver before it compiles: a device, a stream and a target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def is_active(self):
        return True


_SMEM = 232448  # bytes of shared memory a block may use on the H200 (227 KiB opt-in)
driver.set_active(_H200Driver())
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    # the launch would raise OutOfResources here; the compiler does not check it
    if kernel.metadata.shared > _SMEM:
        raise RuntimeError(f"{self.__name__} needs {kernel.metadata.shared} B of shared memory > {_SMEM}")
    return kernel


JITFunction.run = _compile_only

# import every kernel module while TRITON_INTERPRET is unset, then route CPU tensors to the Triton launchers
import flashattn  # noqa: E402
import flashattn.ops.attention  # noqa: E402, F401
import flashattn.ops.block_sparse  # noqa: E402, F401
import flashattn.ops.decode as decode_ops  # noqa: E402
import flashattn.ops.merge as merge_ops  # noqa: E402
from flashattn.bench.providers.base import env_var  # noqa: E402
from flashattn.ops import configs, tma  # noqa: E402

os.environ["TRITON_INTERPRET"] = "1"
_entry = configs._table_entry
configs._table_entry = lambda kernel, block_d, cuda, seqlen=None, causal=False: _entry(
    kernel, block_d, True, seqlen, causal)
_dconf = decode_ops._decode_config
decode_ops._decode_config = lambda bd, es, paged, dev, env, many=False: _dconf(bd, es, paged, "cuda", env,
                                                                                many)
merge_ops.sm_count = decode_ops.sm_count = lambda device: 132
tma.device_ok = lambda t: True  # the fake H200 has the tensor memory accelerator
_tiles = merge_ops.combine_tiles
merge_ops.combine_tiles = lambda n, rows, bd, device: _tiles(n, rows, bd, torch.device("meta"))


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


def _fwd_bwd(fn, *tensors, tma_path="1", ws="1", ws_bwd="0", **kw):
    # tma_path: FLASHATTN_TMA for the call (the aligned padded cases compile both load paths); ws, ws_bwd:
    # FLASHATTN_WS and FLASHATTN_WS_BWD (the plain d = 64/128 cases take the warp-specialised Gluon kernels
    # unless they are 0; the backward's are off by default here so that the Triton backward is compiled for
    # every tile row, and on in the Gluon backward's own cases)
    with env_var("FLASHATTN_TMA", tma_path), env_var("FLASHATTN_WS", ws), env_var("FLASHATTN_WS_BWD", ws_bwd):
        out = fn(*tensors, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))


def _with_config(spec, fn, *args, **kw):
    with env_var("FLASHATTN_CONFIG", spec):
        fn(*args, **kw)


QUICK = "--quick" in sys.argv  # bf16 at the table's head dims only: the CI test's subset


def dense_cases():
    from flashattn import flash_attn_func, flash_attn_varlen_func

    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16, torch.float32):
        # fp32 compiles take ~30-100 s each (ptxas): one head dim covers its DOT_PREC path
        dims = (64, 128, 256) if QUICK else (40, 64, 96, 128, 192, 256) if dtype != torch.float32 else (64,)
        for d in dims:
            for causal in (False, True):
                # (sq, sk, path): short-sequence tile rows on both load paths (with TMA: the Gluon forward),
                # the long rows (N > 2K) on the Triton forward's TMA path
                for sq, sk, path in ((130, 70, "0"), (130, 70, "1"), (2100, 2060, "1")):
                    if dtype == torch.float32 and path == "1":
                        continue
                    q = _t(1, sq, 2, d, dtype=dtype, grad=True)
                    k, v = (_t(1, sk, 1, d, dtype=dtype, grad=True) for _ in range(2))
                    ws = "1" if sq < 2048 else "0"
                    yield f"dense {dtype} d={d} causal={causal} sq={sq} tma={path} ws={ws}", partial(
                        _fwd_bwd, flash_attn_func, q, k, v, causal=causal, tma_path=path, ws=ws)
    # the warp-specialised Gluon forward: d = 128, causal only past 1K (ops/attention_ws.py), fp16 and bf16
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16):
        for causal in (False, True):
            q = _t(1, 1100, 4, 128, dtype=dtype, grad=True)
            k, v = (_t(1, 1100, 2, 128, dtype=dtype, grad=True) for _ in range(2))
            yield f"dense ws {dtype} causal={causal}", partial(_fwd_bwd, flash_attn_func, q, k, v,
                                                                causal=causal)
    # the Gluon backward: d = 64 and 128, causal or not, GQA
    for d in (64, 128):
        for causal in (False, True):
            q = _t(1, 1100, 4, d, grad=True)
            k, v = (_t(1, 1100, 2, d, grad=True) for _ in range(2))
            yield f"dense ws backward d={d} causal={causal}", partial(_fwd_bwd, flash_attn_func, q, k, v,
                                                                       causal=causal, ws_bwd="1")
    # d = 128 without GQA: ptxas crashed (SIGSEGV) on the dK/dV program's descriptor loads at these shapes
    # (sq = 300 with the third session's kernels; 512 causal with 4 heads as well, in the fifth), so that
    # program now loads Q/dO through pointers
    for sq, causal in ((300, False), (300, True), (512, True)):
        q, k, v = (_t(1, sq, 4, 128, grad=True) for _ in range(3))
        yield f"dense d=128 mha sq={sq} causal={causal}", partial(_fwd_bwd, flash_attn_func, q, k, v,
                                                                  causal=causal)
    # 2-stage pipelines must take the pointer path: ptxas crashes on them with descriptors (ops/attention.py)
    q, k, v = (_t(2, 130, 4, 64, grad=True) for _ in range(3))
    yield "dense tma=1 with 2-stage tiles", partial(_with_config, "fwd=64,64,4,2;dkdv=32,64,4,2;dq=64,64,4,2",
                                                    _fwd_bwd, flash_attn_func, q, k, v, causal=True)
    q, k, v = _t(2, 150, 4, 48, grad=True), _t(2, 190, 2, 48, grad=True), _t(2, 190, 2, 32, grad=True)
    yield "dense all features", partial(
        _fwd_bwd, flash_attn_func, q, k, v, dropout_p=0.1, causal=True, window_size=(40, -1), softcap=3.0,
        alibi_slopes=torch.rand(4), learnable_sink=torch.zeros(4, requires_grad=True))
    cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32)
    q, k, v = _t(208, 4, 64, grad=True), _t(208, 2, 64, grad=True), _t(208, 2, 64, grad=True)
    yield "varlen causal", partial(_fwd_bwd, flash_attn_varlen_func, q, k, v, cu, cu, 130, 130, causal=True)


def decode_cases():
    from flashattn import flash_attn_with_kvcache

    hk, d, cap = 2, 128, 1024
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16, torch.float32):
        for group in (4,) if QUICK else (1, 4, 8, 32):
            for sq in (1, 4):
                for page in (None, 16) if QUICK else (None, 16, 64, 256):
                    pool = (2, cap) if page is None else (2 * cap // page, page)
                    kc, vc = _t(*pool, hk, d, dtype=dtype), _t(*pool, hk, d, dtype=dtype)
                    table = None if page is None else torch.arange(pool[0], dtype=torch.int32).view(2, -1)
                    cos, sin = torch.rand(cap, d // 2, dtype=dtype), torch.rand(cap, d // 2, dtype=dtype)
                    yield f"decode {dtype} group={group} sq={sq} page={page}", partial(
                        flash_attn_with_kvcache, _t(2, sq, hk * group, d, dtype=dtype), kc, vc,
                        _t(2, sq, hk, d, dtype=dtype), _t(2, sq, hk, d, dtype=dtype), rotary_cos=cos,
                        rotary_sin=sin, cache_seqlens=torch.tensor([5, 700], dtype=torch.int32),
                        block_table=table, causal=sq > 1)
    # a paged cache read by many programs (40 x 2 > 132 / 2) takes the narrower key tile (ops/decode.py)
    pool = (40 * cap // 64, 64)
    table = torch.arange(pool[0], dtype=torch.int32).view(40, -1)
    yield "decode paged many programs", partial(
        flash_attn_with_kvcache, _t(40, 1, hk * 4, d), _t(*pool, hk, d), _t(*pool, hk, d),
        cache_seqlens=torch.full((40,), 700, dtype=torch.int32), block_table=table)
    yield "decode d=256 window softcap alibi", partial(
        flash_attn_with_kvcache, _t(1, 1, 8, 256), _t(1, 512, 8, 256), _t(1, 512, 8, 256),
        cache_seqlens=torch.tensor([300], dtype=torch.int32), window_size=(64, 0), softcap=5.0,
        alibi_slopes=torch.rand(8))


def sparse_cases():
    from flashattn import BlockMask, block_sparse_attn_func

    masks = {
        "local_global": BlockMask.local_global(1024, 256, 128),
        "mask_mod": BlockMask.from_mask_mod(lambda b, h, i, j: (i - j) % 3 == 0, 1, 1, 1024, 1024),
    }
    for dtype in (torch.bfloat16,) if QUICK else (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            for name, mask in masks.items():
                q = _t(1, 1024, 4, d, dtype=dtype, grad=True)
                k, v = (_t(1, 1024, 2, d, dtype=dtype, grad=True) for _ in range(2))
                yield f"sparse {dtype} d={d} {name}", partial(_fwd_bwd, block_sparse_attn_func, q, k, v, mask)


def main() -> int:
    print("triton", triton.__version__, "target sm_90 (fake driver: compile only)")
    failed = 0
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for group in (dense_cases, decode_cases, sparse_cases):
        if only and group.__name__.removesuffix("_cases") not in only:
            continue
        for name, case in group():
            t0 = time.perf_counter()
            try:
                case()
            except Exception as e:  # report every failing variant, not just the first
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
                continue
            print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
