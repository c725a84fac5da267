"""Small odd-shaped forward+backward for compute-sanitizer (memcheck / racecheck) on the device."""

import torch

from flashattn import flash_attn_func

for b, sq, sk, h, hk, d in [(1, 113, 67, 2, 1, 40), (2, 67, 130, 4, 2, 64), (1, 33, 33, 2, 2, 256)]:
    for causal in (False, True):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=causal)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
print("sanitize case done")
