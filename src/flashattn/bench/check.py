"""Correctness check run before any timing: a provider that is wrong is reported, not timed.

The oracle is fp64 and dense, so for large shapes it runs on a slice that is still exact:
- batch element 0 and the first query heads covering whole GQA groups (kv heads are never split);
- all query rows when that is cheap, else a block of the first and a block of the last rows. A block of rows
  [r0, r1) depends only on the keys it can see, [0, r1 + sk - sq) when causal (bottom-right), so the oracle
  gets exactly those keys;
- a sliding window (case.window) narrows the keys further, to the band the block's rows can see; bounded on
  both sides it affords longer blocks, and a third one in the middle of the sequence;
- packed sequences (case.lengths) are checked on the first two sequences, each row block against the keys
  of its own sequence only, so a checked row that reads another sequence shows up as a wrong output and as
  nonzero dk/dv outside its sequence;
- softcap, a learnable sink (the slice's heads of it) and a v head dim of its own reach the oracle as the
  provider gets them: none of them changes which keys a row sees, so the slicing above holds (the sink's own
  gradient is not compared: the runner differentiates q, k and v; a sink a provider drops or misreads shows
  in the output and in all three of their gradients);
- gradients come from a backward with dout zero outside the checked rows and heads: then the provider's dk/dv
  hold exactly the contributions of the checked rows (summed over blocks), and everything else must be zero.
The yardstick is the naive provider's own low-precision error on the same slice: a provider passes when its
max |error| is within 2x (output) / 3x (gradients) of that plus a floor of two units of rounding.
An FP8 provider computes on its own e4m3 copy of the inputs, so it brings its own oracle (Fp8Oracle, the same
slice): the float64 oracle on that copy's dequantised values, the yardstick plain PyTorch at FP8's precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .case import Case
from .providers.base import first_tensor
from .providers.naive import naive_attention

FWD_FACTOR = 2.0
GRAD_FACTOR = 3.0
# an fp64 score matrix of the check may take this much; the oracle's autograd keeps a few of them
CHECK_BUDGET_BYTES = 256 * 2**20
MIN_BLOCK_ROWS = 64
GRAD_NAMES = ("dq", "dk", "dv")
_GRADS_NOTE = "; grads from dout zero elsewhere"


@dataclass(frozen=True)
class CheckSlice:
    heads_q: int
    heads_k: int
    row_blocks: tuple[tuple[int, int], ...]

    def describe(self, case: Case, grads: bool = True) -> str:
        heads = f"heads 0-{self.heads_q - 1}"
        if self.heads_k != self.heads_q:
            heads += f" (kv heads 0-{self.heads_k - 1})"
        blocks = " & ".join(f"{a}-{b - 1}" for a, b in self.row_blocks)
        mask = f", window {case.window}" if case.window != (-1, -1) else ""
        if case.softcap:
            mask += f", softcap {case.softcap:g}"
        if case.has_sink:
            mask += ", learnable sink"
        if case.lengths is not None:
            seqs = sorted({_sequence_of(case.lengths, a)[2] for a, _ in self.row_blocks})
            which = ", ".join(str(i) for i in seqs)
            rows = (
                f"sequences {which} of {len(case.lengths)} (q rows {blocks} of {case.seqlen_q}, each against "
                f"its own sequence's keys{mask})"
            )
            return f"batch 0 (packed), {heads}, {rows}" + _GRADS_NOTE * grads
        if self.row_blocks == ((0, case.seqlen_q),):
            rows = f"all {case.seqlen_q} q rows{mask}"
        else:
            rows = f"q rows {blocks} of {case.seqlen_q} (with all the keys they see{mask})"
        return f"batch 0, {heads}, {rows}" + _GRADS_NOTE * grads

    def key_end(self, case: Case, row_end: int) -> int:
        if not case.causal:
            return case.seqlen_k
        return max(0, min(case.seqlen_k, row_end + case.seqlen_k - case.seqlen_q))

    def key_range(self, case: Case, r0: int, r1: int) -> tuple[int, int, bool, tuple[int, int]]:
        """Keys [k0, k1) that q rows [r0, r1) can see, and the (causal, window_size) that make attention_ref
        on q[r0:r1], k[k0:k1] reproduce the case's mask exactly.

        attention_ref aligns the sub-problem bottom-right (local diagonal i + (k1 - k0) - (r1 - r0)), while
        the case's diagonal sits at local i + r0 + offset - k0; shifting the window by the difference
        restores it.
        """
        if not case.masked:
            return 0, self.key_end(case, r1), case.causal, (-1, -1)
        left, right = case.window
        if case.causal:
            right = 0
        if case.lengths is None:
            seg0, seg1, offset = 0, case.seqlen_k, case.seqlen_k - case.seqlen_q
        else:
            seg0, seg1, _ = _sequence_of(case.lengths, r0)
            if r1 > seg1:
                raise ValueError(f"row block {r0}-{r1 - 1} spans two packed sequences")
            offset = 0
        k0 = seg0 if left < 0 else max(seg0, r0 + offset - left)
        k1 = seg1 if right < 0 else min(seg1, r1 + offset + right)
        shift = (r0 + offset - k0) - ((k1 - k0) - (r1 - r0))
        return k0, k1, False, (-1 if left < 0 else left - shift, -1 if right < 0 else right + shift)


def _sequence_of(lengths: tuple[int, ...], row: int) -> tuple[int, int, int]:
    """(start, end, index) of the packed sequence holding token `row`."""
    start = 0
    for i, n in enumerate(lengths):
        if start <= row < start + n:
            return start, start + n, i
        start += n
    raise ValueError(f"token {row} is past the {start} packed tokens")


def choose_slice(case: Case, budget_bytes: int = CHECK_BUDGET_BYTES) -> CheckSlice:
    group = case.nheads // case.nheads_k
    heads_k = min(case.nheads_k, -(-2 // group))  # whole groups, at least two query heads when there are two
    heads_q = heads_k * group
    if case.lengths is not None:
        # the first two non-empty sequences, each sliced like a problem of its own
        blocks: list[tuple[int, int]] = []
        start, taken = 0, 0
        for n in case.lengths:
            if n and taken < 2:
                blocks += [(start + a, start + b) for a, b in _row_blocks(n, n, heads_q, budget_bytes)]
                taken += 1
            start += n
        return CheckSlice(heads_q, heads_k, tuple(blocks))
    left, right = case.window
    if left >= 0 and (right >= 0 or case.causal):
        return CheckSlice(heads_q, heads_k, _band_blocks(case, heads_q, budget_bytes))
    return CheckSlice(heads_q, heads_k, _row_blocks(case.seqlen_q, case.seqlen_k, heads_q, budget_bytes))


def _band_blocks(case: Case, heads_q: int, budget_bytes: int) -> tuple[tuple[int, int], ...]:
    """A window bounded on both sides: R rows see at most R + left + right keys, so the budget buys far more
    rows than full attention, and a third block in the middle checks the band where neither edge clips it."""
    span = case.window[0] + (0 if case.causal else case.window[1])
    per_block = budget_bytes / (3 * heads_q * 8)  # rows * (rows + span) of each of three blocks
    rows = max(MIN_BLOCK_ROWS, int((-span + math.sqrt(span * span + 4 * per_block)) / 2))
    sq = case.seqlen_q
    if 3 * rows >= sq:
        return ((0, sq),)
    mid = sq // 2 - rows // 2
    return ((0, rows), (mid, mid + rows), (sq - rows, sq))


def _row_blocks(seqlen_q: int, seqlen_k: int, heads_q: int, budget_bytes: int) -> tuple[tuple[int, int], ...]:
    rows = max(MIN_BLOCK_ROWS, budget_bytes // (heads_q * seqlen_k * 8))
    if rows >= seqlen_q:
        return ((0, seqlen_q),)
    half = max(1, rows // 2)
    return ((0, half), (seqlen_q - half, seqlen_q))


def _reference(q, k, v, causal, window=(-1, -1), **options):
    """The package's dense oracle; float64 in, float64 out. `options`: softcap, learnable_sink."""
    from flashattn.reference import attention_ref

    out = attention_ref(q, k, v, causal=causal, window_size=window, upcast=True, **options)
    return first_tensor(out).to(torch.float64)


REFERENCE = "flashattn.reference.attention_ref(upcast=True) on float64 inputs"


def _naive_bshd(q, k, v, causal, window=(-1, -1), **options):
    if window != (-1, -1) or options:
        # the same low-precision recipe as naive (scores in the input dtype, softmax in fp32), with the
        # window, softcap and sink that naive does not take
        from flashattn.reference import attention_ref

        out = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False, **options)
        return first_tensor(out)
    return naive_attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal).transpose(1, 2)


def _options(case: Case, heads_q: int, device: torch.device) -> dict:
    """The case's softcap and learnable sink as attention_ref's keywords, the sink cut to the checked heads;
    none for a case without them, so the oracle's calls stay what they were."""
    options: dict = {}
    if case.softcap:
        options["softcap"] = case.softcap
    sink = case.learnable_sink(device)
    if sink is not None:
        options["learnable_sink"] = sink[:heads_q]
    return options


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


@dataclass
class Verdict:
    fwd_error: str | None
    bwd_error: str | None
    out_err: float | None
    out_rel: float | None
    grad_err: float | None = None
    grad_rel: float | None = None

    def error_for(self, mode: str) -> str | None:
        return self.fwd_error if mode == "fwd" else self.fwd_error or self.bwd_error

    def err_for(self, mode: str) -> tuple[float | None, float | None]:
        if mode == "fwd" or self.grad_err is None:
            return self.out_err, self.out_rel
        if mode == "bwd":
            return self.grad_err, self.grad_rel
        return max(self.out_err or 0.0, self.grad_err), max(self.out_rel or 0.0, self.grad_rel or 0.0)


class Oracle:
    """Reference output/gradients and tolerances for one case, computed once and shared by every provider."""

    def __init__(self, case: Case, q, k, v, dout, *, grads: bool, budget_bytes: int = CHECK_BUDGET_BYTES):
        self.case = case
        self.slice = choose_slice(case, budget_bytes)
        self.checked_on = self.slice.describe(case)
        self.grads = grads
        dtype = q.dtype
        # only the checked rows and heads of dout are read: the same values masked_dout keeps
        ref_out, ref_grads = self._run(_reference, q, k, v, dout, torch.float64)
        base_out, base_grads = self._run(_naive_bshd, q, k, v, dout, dtype)
        self.ref_out = ref_out
        self.ref_grads = ref_grads
        self.out_tol = self._tol(FWD_FACTOR, base_out, ref_out, dtype)
        self.grad_tols = [
            self._tol(GRAD_FACTOR, b, r, dtype) for b, r in zip(base_grads, ref_grads, strict=True)
        ]

    @staticmethod
    def _tol(factor: float, base: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
        return factor * _max_abs(base.double() - ref) + 2 * _eps(dtype) * _max_abs(ref)

    def _run(self, fn, q, k, v, dout, dtype):
        """Output rows of every block (concatenated) and, if asked, dq rows / dk / dv summed over blocks."""
        s, case = self.slice, self.case
        options = _options(case, s.heads_q, q.device)
        sub = [x[:1, :, : (s.heads_q if i in (0, 3) else s.heads_k)] for i, x in enumerate((q, k, v, dout))]
        outs, dqs = [], []
        dk = torch.zeros(sub[1].shape, dtype=torch.float64, device=q.device)
        dv = torch.zeros(sub[2].shape, dtype=torch.float64, device=q.device)
        for r0, r1 in s.row_blocks:
            k0, k1, causal, window = s.key_range(case, r0, r1)
            if k1 <= k0:
                # causal with sk < sq (or a window past the keys): no key is visible, so output and dq are 0
                outs.append(torch.zeros(sub[3][:, r0:r1].shape, dtype=torch.float64, device=q.device))
                dqs.append(torch.zeros(sub[0][:, r0:r1].shape, dtype=torch.float64, device=q.device))
                continue
            qb = sub[0][:, r0:r1].to(dtype).requires_grad_(self.grads)
            kb = sub[1][:, k0:k1].to(dtype).requires_grad_(self.grads)
            vb = sub[2][:, k0:k1].to(dtype).requires_grad_(self.grads)
            with torch.enable_grad():
                ob = fn(qb, kb, vb, causal, window, **options)
            outs.append(ob.detach().double())
            if self.grads:
                gq, gk, gv = torch.autograd.grad(ob, (qb, kb, vb), sub[3][:, r0:r1].to(ob.dtype))
                dqs.append(gq.double())
                dk[:, k0:k1] += gk.double()
                dv[:, k0:k1] += gv.double()
        grads = [torch.cat(dqs, dim=1), dk, dv] if self.grads else []
        return torch.cat(outs, dim=1), grads

    def masked_dout(self, dout: torch.Tensor) -> torch.Tensor:
        """dout restricted to the checked rows and heads of batch element 0, zero elsewhere."""
        masked = torch.zeros_like(dout)
        for a, b in self.slice.row_blocks:
            masked[:1, a:b, : self.slice.heads_q] = dout[:1, a:b, : self.slice.heads_q]
        return masked

    def _take_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, a:b] for a, b in self.slice.row_blocks], dim=1)

    def check(self, out: torch.Tensor, grads: list[torch.Tensor] | None) -> Verdict:
        """out and grads in (b, s, h, d), as the provider returned them for masked_dout(dout)."""
        s = self.slice
        out = out.detach()
        grads = None if grads is None else [g.detach() for g in grads]
        where = f"on {self.checked_on}"
        if not torch.isfinite(out).all():
            return Verdict("wrong result: non-finite values in the output", None, float("nan"), None)
        got = self._take_rows(out[:1, :, : s.heads_q]).double()
        out_err = _max_abs(got - self.ref_out)
        out_rel = out_err / max(_max_abs(self.ref_out), 1e-30)
        fwd_error = None
        if not out_err <= self.out_tol:
            fwd_error = f"wrong result: output max|err| {out_err:.3g} > tolerance {self.out_tol:.3g} {where}"
        verdict = Verdict(fwd_error, None, out_err, out_rel)
        if grads is None or not self.grads:
            return verdict
        errs, rels, problems = [], [], []
        for name, g, ref, tol in zip(GRAD_NAMES, grads, self.ref_grads, self.grad_tols, strict=True):
            if not torch.isfinite(g).all():
                problems.append(f"{name} has non-finite values")
                continue
            heads = s.heads_q if name == "dq" else s.heads_k
            mine = g[:1, :, :heads]
            if name == "dq":
                mine = self._take_rows(mine)
            err = _max_abs(mine.double() - ref)
            errs.append(err)
            rels.append(err / max(_max_abs(ref), 1e-30))
            if not err <= tol:
                problems.append(f"{name} max|err| {err:.3g} > tolerance {tol:.3g}")
            leak = g.clone()
            if name == "dq":
                for a, b in s.row_blocks:
                    leak[:1, a:b, :heads] = 0
            else:
                leak[:1, :, :heads] = 0
            if not _max_abs(leak) <= tol:
                problems.append(f"{name} is {_max_abs(leak):.3g} where dout is zero (expected 0)")
        verdict.grad_err = max(errs) if errs else None
        verdict.grad_rel = max(rels) if rels else None
        if problems:
            verdict.bwd_error = "wrong result: " + "; ".join(problems) + f" {where}"
        return verdict


# the FP8 tolerance's floor: the output's own rounding (2^-11 relative in fp16 for |out| <= 1), as the FP8
# forward's tests take it
FP8_FLOOR = 1e-3


def _descale_slice(descale: torch.Tensor, s: CheckSlice, nheads: int) -> torch.Tensor:
    """A descale cut to the checked slice: (1,) stays, (batch, heads) keeps batch 0 and the checked heads
    (q's may be per query head or per kv head: its width says which)."""
    if descale.numel() == 1:
        return descale.reshape(1)
    return descale[:1, : (s.heads_q if descale.shape[1] == nheads else s.heads_k)]


class Fp8Oracle(Oracle):
    """The check of an FP8 provider: its output against the float64 oracle on the dequantised values of its
    own e4m3 inputs (attention_ref_fp8(upcast=True)), within FWD_FACTOR times the error of plain PyTorch
    computing the call at FP8's precision (upcast=False: float32 q·k, the softmax numerators rounded to e4m3
    as an FP8 P·V product takes them) plus FP8_FLOOR; on the slice choose_slice picks, forward only.

    q8 (batch, seqlen_q, nheads, d), k8 (batch, seqlen_k, nheads_k, d), v8 (batch, seqlen_k, nheads_k, dv):
    torch.float8_e4m3fn, any strides (v8 may have its seqlen dim contiguous). q_descale float32 (1,),
    (batch, nheads) or (batch, nheads_k); k_descale, v_descale (1,) or (batch, nheads_k). out_dtype: the
    provider's output dtype, which the baseline rounds to as well. `check` and `masked_dout` are Oracle's.
    """

    def __init__(self, case: Case, q8, k8, v8, q_descale, k_descale, v_descale, *, out_dtype: torch.dtype,
                 budget_bytes: int = CHECK_BUDGET_BYTES):
        from flashattn.reference import attention_ref_fp8

        self.case = case
        self.slice = s = choose_slice(case, budget_bytes)
        self.checked_on = s.describe(case, grads=False) + "; the oracle on the dequantised e4m3 inputs"
        self.grads = False
        q8, k8, v8 = q8[:1, :, : s.heads_q], k8[:1, :, : s.heads_k], v8[:1, :, : s.heads_k]
        descales = [_descale_slice(d, s, case.nheads) for d in (q_descale, k_descale, v_descale)]
        options = _options(case, s.heads_q, q8.device)
        refs, bases = [], []
        for r0, r1 in s.row_blocks:
            k0, k1, causal, window = s.key_range(case, r0, r1)
            if k1 <= k0:
                # no key is visible (causal with sk < sq, or a window past the keys): the output is 0
                shape = (1, r1 - r0, s.heads_q, v8.shape[-1])
                zeros = torch.zeros(shape, dtype=torch.float64, device=q8.device)
                refs.append(zeros)
                bases.append(zeros)
                continue
            args = (q8[:, r0:r1], k8[:, k0:k1], v8[:, k0:k1], *descales)
            kwargs = dict(causal=causal, window_size=window, **options)
            refs.append(first_tensor(attention_ref_fp8(*args, upcast=True, **kwargs)).double())
            base = attention_ref_fp8(*args, upcast=False, out_dtype=out_dtype, **kwargs)
            bases.append(first_tensor(base).double())
        self.ref_out = torch.cat(refs, dim=1)
        self.out_tol = FWD_FACTOR * _max_abs(torch.cat(bases, dim=1) - self.ref_out) + FP8_FLOOR
        self.ref_grads, self.grad_tols = [], []
