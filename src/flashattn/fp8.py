"""FP8 (e4m3) inputs for attention: quantisation with descale factors, and incoherent processing.

Hopper's tensor cores run e4m3 at twice the bf16 rate. An FP8 attention call takes q, k, v in
`torch.float8_e4m3fn` with float32 descale factors (the value of x is x_fp8 · descale), FlashAttention-3's
convention: `q_descale`, `k_descale`, `v_descale` per tensor (shape (1,)) or per (batch, kv head) (shape
(batch, nheads_k)).

Incoherent processing (FlashAttention-3, from QuIP): multiplying q and k by the same random orthogonal matrix
R = H·diag(s) / sqrt(d) (H a Hadamard matrix, s random signs) leaves QKᵀ unchanged (R Rᵀ = I) but spreads
an outlier's magnitude over every coordinate of its row, so a per-tensor scale wastes less of e4m3's range.

    q8, qd = quantize(q)                        # per tensor
    k8, kd = quantize(k, "head")                # per (batch, kv head)
    q8, qd = quantize(q, "head", rotate_seed=0)  # rotated and quantised in one pass pair (the same seed
    k8, kd = quantize(k, "head", rotate_seed=0)  # for q and k); rotate_qk(q, k, seed) rotates alone

On a GPU quantize runs two fused Triton kernels (the largest magnitude, then the cast; 2 + 3 bytes of
traffic per 16-bit element), else the same arithmetic in torch.

Shapes follow the attention API: (batch, seqlen, nheads, headdim).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashattn import backends
from flashattn.errors import FlashAttnError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
GRANULARITIES = ("tensor", "head")


def _check_input(x, name: str) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise FlashAttnError(f"{name} must be a 4-D tensor (batch, seqlen, nheads, headdim), got {got}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FlashAttnError(f"{name} has dtype {x.dtype}; expected float16, bfloat16 or float32 to quantize")


def quantize(x: Tensor, granularity: str = "tensor", *, seq_contiguous: bool = False,
             rotate_seed: int | None = None, name: str = "x") -> tuple[Tensor, Tensor]:
    """(x_fp8, descale) with x ≈ x_fp8 · descale, the scale the largest power of two that keeps the largest
    |x| within e4m3's range (it lands in (224, 448]). A power of two makes the scaling exact: every backend
    and device gives the same bits, and dequantising adds no rounding.

    Arguments:
        x: (batch, seqlen, nheads, headdim), float16 / bfloat16 / float32.
        granularity: "tensor" (one scale, descale shape (1,)) or "head" (one per (batch, head), descale
            shape (batch, nheads)), default "tensor".
        seq_contiguous: bool, keyword only, default False. True lays x_fp8 out with its seqlen dim
            contiguous (storage (batch, nheads, headdim, seqlen)): V as the FP8 P·V product takes it
            (K-major), which an FP8 attention call reads without transposing its tiles.
        rotate_seed: int or None, keyword only, default None. Quantise x·R instead of x, R =
            rotation(headdim, rotate_seed) (incoherent processing: give q and k the same seed), computed in
            float32 on the way (headdim a power of two, at least 16).
        name: the argument's name in error messages.
    Returns:
        x_fp8: like x, torch.float8_e4m3fn; contiguous, or seqlen-contiguous.
        descale: float32, (1,) or (batch, nheads); an all-zero x (or an empty one) gets descale 1.
    """
    _check_input(x, name)
    if granularity not in GRANULARITIES:
        raise FlashAttnError(f"granularity is {granularity!r}; expected one of {', '.join(GRANULARITIES)}")
    signs = None
    if rotate_seed is not None:
        d = x.shape[-1]
        if d < 16:
            raise FlashAttnError(f"{name} has headdim {d}; quantize's rotation needs a power of two >= 16")
        signs = signed_hadamard(d, rotate_seed)
    return backends.entry(x).quantize_fp8(x, per_head=granularity == "head", seq_contiguous=seq_contiguous,
                                          rotation=signs)


def dequantize(x8: Tensor, descale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """x8 · descale in `dtype`: descale (1,) (per tensor) or (batch, nheads) (per head) for x8 (batch,
    seqlen, nheads, headdim)."""
    check_descale("descale", descale, x8)
    d = descale.float()
    d = d.reshape(1, 1, 1, 1) if d.numel() == 1 else d[:, None, :, None]
    return (x8.float() * d).to(dtype)


def check_descale(name: str, descale, x8: Tensor) -> None:
    """A descale for x8 (batch, seqlen, nheads, headdim): float32 (1,) or (batch, nheads), on x8's
    device."""
    b, h = x8.shape[0], x8.shape[2]
    if not isinstance(descale, Tensor) or descale.dtype != torch.float32:
        got = descale.dtype if isinstance(descale, Tensor) else type(descale).__name__
        raise FlashAttnError(f"{name} must be a float32 tensor of shape (1,) or ({b}, {h}), got {got}")
    if tuple(descale.shape) not in ((1,), (), (b, h)):
        raise FlashAttnError(f"{name} has shape {tuple(descale.shape)}; expected (1,) (per tensor) or "
                             f"({b}, {h}) (per batch and kv head)")
    if descale.device != x8.device:
        raise FlashAttnError(f"{name} is on {descale.device} but its tensor on {x8.device}")


def hadamard(d: int, *, device=None, dtype=torch.float32) -> Tensor:
    """The (d, d) Sylvester Hadamard matrix divided by sqrt(d): orthogonal; d a power of two."""
    if d < 1 or d & (d - 1):
        raise FlashAttnError(f"the head dim is {d}; a Hadamard rotation needs a power of two")
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / d ** 0.5


def signed_hadamard(d: int, seed: int = 0) -> Tensor:
    """H · diag(s), float32 (d, d) with entries ±1: the Sylvester Hadamard matrix (unnormalised) with its
    columns' signs drawn from `seed`; d a power of two."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return (hadamard(d) * d ** 0.5).round() * signs[None, :]


def rotation(d: int, seed: int = 0, *, device=None) -> Tensor:
    """The random orthogonal R = H · diag(s) / sqrt(d) (float32, (d, d)) that rotate_qk and quantize's
    rotate_seed apply; s: random signs drawn from `seed`."""
    return (signed_hadamard(d, seed) * d ** -0.5).to(device)


def rotate_qk(q: Tensor, k: Tensor, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(q R, k R) in q's and k's dtypes, R = rotation(headdim, seed): QKᵀ is unchanged, outliers are spread
    over the head dim. q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d); d a power of two."""
    _check_input(q, "q")
    _check_input(k, "k")
    if q.shape[-1] != k.shape[-1]:
        raise FlashAttnError(f"k has headdim {k.shape[-1]} but q has {q.shape[-1]}; they must match")
    r = rotation(q.shape[-1], seed, device=q.device)
    return (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)
