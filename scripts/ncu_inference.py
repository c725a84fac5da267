"""One inference call, for Nsight Compute: the FP8 forward (or the bf16 one beside it), or a decode step.

    ncu --kernel-name regex:attn_fwd_ws --launch-skip 2 --launch-count 1 --section ... \
        python scripts/ncu_inference.py fwd D N [causal] [fp8]
    ncu --kernel-name regex:decode_kernel --launch-skip 2 --launch-count 1 --section ... \
        python scripts/ncu_inference.py decode B KV [fp8] [page=P] [cudnn]

fwd: b x N = 16K tokens, h = 2048 / d (the fp8 suite's grid), q, k, v quantised per tensor with V laid out
seqlen-contiguous (the layout the FP8 P.V product reads without a copy); without `fp8`, the same call in
bf16. decode: one query per sequence, 32 query heads on 8 KV heads, d 128, every sequence KV keys, the
cache bf16 or e4m3 (per (sequence, KV head) descales), contiguous or paged; `cudnn`: SDPA-cuDNN's step on
the same contiguous bf16 cache instead (enable_gqa; its kernels' names hold "sdpa"). Three calls run, so the
profiled launch (skip 2) is compiled and cached.
"""

import sys

import torch

from flashattn import flash_attn_func, flash_attn_with_kvcache
from flashattn.fp8 import quantize

args = sys.argv[1:]
flags = set(args[3:])
fp8 = "fp8" in flags
torch.manual_seed(0)
if args[0] == "fwd":
    d, n = int(args[1]), int(args[2])
    shape = (16384 // n, n, 2048 // d, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kwargs = {}
    if fp8:
        (q, qd), (k, kd) = quantize(q), quantize(k)
        v, vd = quantize(v, seq_contiguous=True)
        kwargs = dict(q_descale=qd, k_descale=kd, v_descale=vd)

    def call():
        return flash_attn_func(q, k, v, causal="causal" in flags, **kwargs)
else:
    from tune_decode_tiles import decode_inputs  # this script's folder is on sys.path

    b, kv = int(args[1]), int(args[2])
    page = next((int(f.split("=")[1]) for f in flags if f.startswith("page=")), None)
    q, k, v, seqlens, table, kwargs = decode_inputs(b, kv, page, 32, 8, 128, torch.device("cuda"),
                                                    torch.bfloat16, fp8)

    def call():
        return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, **kwargs)
    if "cudnn" in flags:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
for _ in range(3):
    call()
torch.cuda.synchronize()
print("profiled", args, flush=True)
