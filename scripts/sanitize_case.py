"""Small odd-shaped forward+backward for compute-sanitizer (memcheck / racecheck) on the device."""

import torch

from flashattn import flash_attn_func, flash_attn_varlen_func


def _grad_check(out, *inputs):
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in inputs)


def _qkv(*shapes):
    return [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes]


for b, sq, sk, h, hk, d in [(1, 113, 67, 2, 1, 40), (2, 67, 130, 4, 2, 64), (1, 33, 33, 2, 2, 256)]:
    for causal in (False, True):
        q, k, v = _qkv((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
        _grad_check(flash_attn_func(q, k, v, causal=causal), q, k, v)
# every feature at once, and varlen with empty sequences
q, k, v = _qkv((2, 150, 4, 48), (2, 190, 2, 48), (2, 190, 2, 32))
sink = torch.zeros(4, device="cuda", requires_grad=True)
out = flash_attn_func(q, k, v, dropout_p=0.1, causal=True, window_size=(40, -1), softcap=3.0,
                      alibi_slopes=torch.rand(4, device="cuda"), learnable_sink=sink)
_grad_check(out, q, k, v, sink)
lens = [0, 77, 1, 130]
cu = torch.tensor([0, 0, 77, 78, 208], dtype=torch.int32, device="cuda")
q, k, v = _qkv((sum(lens), 4, 64), (sum(lens), 2, 64), (sum(lens), 2, 64))
_grad_check(flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True), q, k, v)
print("sanitize case done")
