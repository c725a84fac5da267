"""One forward or backward call of the plain training shape, for Nsight Compute's stall and pipe sections.

    ncu --kernel-name regex:attn_bwd_ws --launch-skip 2 --launch-count 1 --section WarpStateStats ... \
        python scripts/ncu_case.py D N [causal] [fwd] [cudnn] [fa4] [triton] [dv=DV]

b x N = 16K tokens, h = 2048 / d, bf16 (the train suite's grid); dv=DV gives V another head dim (192 with
dv=128: the DeepSeek prefill shape). Warm-up calls come first, so the launch that
is profiled is compiled and cached (skip 2 launches of the kernel); `triton` runs the Triton kernels' routes
instead of the default ones; `cudnn` profiles SDPA's cuDNN backend on the same tensors instead (its kernels'
names contain "sdpa"); `fa4` FlashAttention-4's flash_attn.cute (its sm90 backward: "BackwardSm90").
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashattn import flash_attn_func

d, n = int(sys.argv[1]), int(sys.argv[2])
causal = "causal" in sys.argv[3:]
forward_only = "fwd" in sys.argv[3:]
dv = next((int(a[3:]) for a in sys.argv[3:] if a.startswith("dv=")), d)
shape = (16384 // n, n, 2048 // d, d)
q, k, v = (torch.randn(*shape[:3], dim, device="cuda", dtype=torch.bfloat16, requires_grad=not forward_only)
           for dim in (d, d, dv))


def cudnn(q, k, v, causal):
    """The same call through SDPA's cuDNN backend, on (b, h, n, d) views."""
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    return out.transpose(1, 2)


if "triton" in sys.argv[3:]:
    # a script's A/B choice: the Triton routes for every call of this process
    from flashattn.backends.triton import routes

    routes.forward_route, routes.backward_route = routes.triton_forward_route, routes.triton_backward_route


def fa4(q, k, v, causal):
    """The same call through FlashAttention-4 (its wheels on the path: scripts/device_run.sh)."""
    from flash_attn.cute.interface import flash_attn_func as fa4_func

    out = fa4_func(q, k, v, causal=causal)
    return out[0] if isinstance(out, tuple) else out


attend = cudnn if "cudnn" in sys.argv[3:] else fa4 if "fa4" in sys.argv[3:] else flash_attn_func
if forward_only:
    for _ in range(3):
        out = attend(q, k, v, causal=causal)
else:
    out = attend(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
torch.cuda.synchronize()
print("profiled", shape, f"dv {dv}", "causal" if causal else "full",
      "forward" if forward_only else "backward", flush=True)
