"""Shared test helpers: what this machine runs (backends, dtypes, the interpreter), the tolerance rule,
random (optionally non-contiguous) inputs, a launch recorder, the
(head, tile) pairs a kernel's 1D program mapping assigns."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

BACKENDS = ["torch"] + (["triton"] if (HAS_CUDA or INTERPRET) else [])

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def backend_dtypes(backend: str) -> list[torch.dtype]:
    """The dtypes a backend is tested with on this machine."""
    if is_interpreted(backend):
        # The Triton interpreter emulates bf16 incorrectly (numpy has no bf16), and it is slow: the API tests
        # run it in fp16 only; tests/backends/triton/test_interpret.py runs the kernels in fp16 and fp32.
        return [torch.float16]
    return [torch.float16, torch.bfloat16, torch.float32]


def is_interpreted(backend: str) -> bool:
    """True when ``backend`` runs Triton kernels through the (slow) CPU interpreter."""
    return backend == "triton" and (INTERPRET or not HAS_CUDA)


# Interpreter cost is per tile visited (numpy emulation, ~5 ms a tile), not per flop: a case is skipped on
# the interpreted backend above b * h * ceil(sq / 32) * ceil(sk / 32) tiles (113 x 113 at b = h = 2 is 64);
# tests/backends/triton/test_interpret.py covers the kernels there with chosen multi-tile shapes.
INTERPRET_TILE_BUDGET = 32


def skip_if_too_slow(backend: str, b: int, h: int, sq: int, sk: int, d: int) -> None:
    del d  # the interpreter's cost hardly depends on the head dim
    tiles = b * h * -(-sq // 32) * -(-sk // 32)
    if is_interpreted(backend) and tiles > INTERPRET_TILE_BUDGET:
        pytest.skip("too slow for the Triton interpreter (covered by test_triton_interpret.py and on GPU)")

__all__ = ["LaunchRecorder", "assert_close_to_ref", "keep_mask", "make_qkv", "max_abs_err", "program_pairs"]


def keep_mask(s_dmask, seqlen_q=None, seqlen_k=None):
    """The dropout keep mask in flash_attn's S_dmask (batch, nheads, rows, cols): True where the sign bit is
    clear (a dropped entry is negative, -0.0 included), cut to (seqlen_q, seqlen_k) when given (varlen:
    pass nothing; sequence b's mask is [b, :, :len_q, :len_k])."""
    s = s_dmask if seqlen_q is None else s_dmask[:, :, :seqlen_q, :seqlen_k]
    return ~torch.signbit(s)


def max_abs_err(a, b):
    """Max |a - b| over entries where b is finite, in float64 (0.0 for empty tensors)."""
    a, b = a.detach().double(), b.detach().double()
    fin = torch.isfinite(b)
    if not fin.any():
        return 0.0
    return (a[fin] - b[fin]).abs().max().item()


def _describe(t):
    t = t.detach()
    nan, pinf, ninf = (int(f(t).sum()) for f in (torch.isnan, torch.isposinf, torch.isneginf))
    return f"nan={nan} +inf={pinf} -inf={ninf}"


def assert_close_to_ref(out, out_ref, out_pt, *, factor=2.0, atol_floor=1e-5, name="out"):
    """The tolerance rule: ``max|out - ref| <= factor * max|out_pt - ref| + atol_floor``.

    ``out_ref`` is the float64 oracle, ``out_pt`` plain PyTorch in the same low precision as ``out``, so the
    bound scales with the precision actually being tested (factor 2 for outputs, 3 for gradients).
    Infinite entries of the reference (LSE = +inf rows) must be matched exactly, position and sign.
    """
    if out.shape != out_ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference shape {tuple(out_ref.shape)}")
    o, r, p = out.detach().double().cpu(), out_ref.detach().double().cpu(), out_pt.detach().double().cpu()
    problems = []
    if torch.isnan(o).any():
        problems.append(f"{int(torch.isnan(o).sum())} NaN entries")
    ref_inf = torch.isinf(r)
    inf_bad = (ref_inf & (o != r)) | (~ref_inf & torch.isinf(o))
    if inf_bad.any():
        idx = inf_bad.nonzero()[:5].tolist()
        problems.append(f"{int(inf_bad.sum())} entries disagree on +-inf, first at {idx}")
    fin = torch.isfinite(r) & torch.isfinite(o)
    diff = torch.zeros_like(r)
    diff[fin] = (o[fin] - r[fin]).abs()
    err = diff.max().item() if diff.numel() else 0.0
    pt_err = max_abs_err(p, r)
    tol = factor * pt_err + atol_floor
    if err > tol:
        bad = (diff > tol).nonzero()[:5]
        first = ", ".join(
            f"{tuple(i)}: got {o[tuple(i)].item():.6g} ref {r[tuple(i)].item():.6g}" for i in bad.tolist()
        )
        problems.append(
            f"max err {err:.4g} > tol {tol:.4g} (= {factor} * pt err {pt_err:.4g} + {atol_floor:g}); "
            f"mean err {diff[fin].mean().item():.4g}; {int((diff > tol).sum())}/{diff.numel()} entries "
            f"over; first: {first}"
        )
    if problems:
        raise AssertionError(
            f"{name} {tuple(out.shape)} {out.dtype}: " + "; ".join(problems)
            + f"\n  out: {_describe(o)}; ref: {_describe(r)}; pt: {_describe(p)}"
        )


def make_qkv(
    b,
    sq,
    sk,
    h,
    hk,
    d,
    dtype=torch.float32,
    device="cpu",
    dv=None,
    layout="contiguous",
    *,
    scale=1.0,
    requires_grad=False,
    generator=None,
):
    """Random q ``(b, sq, h, d)``, k ``(b, sk, hk, d)``, v ``(b, sk, hk, dv)``.

    layout:
        ``"contiguous"``: plain tensors.
        ``"strided"``: non-contiguous views with a contiguous last dim: when the shapes allow it (sq == sk,
            h == hk, dv == d) slices of one packed ``(b, s, 3, h, d)`` qkv tensor, otherwise views of
            ``(b, heads, s, dim + 8)`` buffers transposed to ``(b, s, heads, dim)`` and cut to ``dim``.

    ``scale`` multiplies the values (use it for extreme logits).  With ``requires_grad`` the views are
    part of an autograd graph (non-leaf when strided): differentiate with ``torch.autograd.grad``.
    """
    dv = d if dv is None else dv

    def rand(*shape):
        x = torch.randn(*shape, generator=generator, dtype=torch.float32) * scale
        x = x.to(device=device, dtype=dtype)
        return x.requires_grad_(requires_grad)

    if layout == "contiguous":
        return rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, dv)
    if layout != "strided":
        raise ValueError(f"layout={layout!r}; expected 'contiguous' or 'strided'")
    if sq == sk and h == hk and dv == d:
        qkv = rand(b, sq, 3, h, d)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def strided(s, heads, dim):
        return rand(b, heads, s, dim + 8).transpose(1, 2)[..., :dim]

    return strided(sq, h, d), strided(sk, hk, d), strided(sk, hk, dv)


class LaunchRecorder:
    """Wraps a Triton kernel: kernel[grid](...) is recorded in calls (the grid; with `options`, also the
    launch options named there, e.g. ("num_warps", "maxnreg")), then launched."""

    def __init__(self, kernel, calls, options=()):
        self.kernel, self.calls, self.options = kernel, calls, options

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        if not self.options:
            self.calls.append(grid)
            return launch

        def run(*args, **kwargs):
            self.calls.append((grid, {name: kwargs.get(name) for name in self.options}))
            return launch(*args, **kwargs)

        return run


@triton.jit
def _record_pairs(out, n_bh, n_tiles, arg, MAPPING: tl.constexpr):
    pid = tl.program_id(0)
    bh, tile = MAPPING(pid, n_bh, n_tiles, arg)
    tl.store(out + 2 * pid, bh)
    tl.store(out + 2 * pid + 1, tile)


def program_pairs(mapping, n_programs, n_bh, n_tiles, arg) -> list[tuple[int, int]]:
    """(batch·head, tile) of each of n_programs programs, in launch order, as the @triton.jit `mapping`
    (pid, n_bh, n_tiles, arg) -> (bh, tile) assigns them (run under TRITON_INTERPRET=1)."""
    out = torch.full((n_programs, 2), -1, dtype=torch.int32)
    _record_pairs[(n_programs,)](out, n_bh, n_tiles, arg, MAPPING=mapping)
    return [tuple(p) for p in out.tolist()]


def use_tiles(monkeypatch, spec) -> None:
    """Replace rows of the tile table for one test (flashattn.config's tile overrides; None: the table)."""
    from flashattn import config

    monkeypatch.setattr(config, "tile_overrides", config.parse_tiles(spec) if isinstance(spec, str) else {})
    monkeypatch.setattr(config, "generation", config.generation + 1)


# An ncu --csv report in its long format (one metric a row), as the IO model's and the bench's tests read it
NCU_LONG = """\
==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "attn_fwd_kernel": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","402,653,184"
"0","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","138,412,032"
"0","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(8, 1024, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","351,232"
"1","4242","python3","127.0.0.1","attn_bwd_preprocess_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","268.44"
"1","4242","python3","127.0.0.1","attn_bwd_preprocess_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","4,194.30"
"1","4242","python3","127.0.0.1","attn_bwd_preprocess_kernel","1","7","(128, 1, 1)","(16, 1024, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","70,50"
==PROF== Disconnected from process 4242
"""  # noqa: E501
