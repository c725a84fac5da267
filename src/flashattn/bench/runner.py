"""Runs a suite: for each case, every provider is set up, checked against the oracle, then timed per mode."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from . import providers as provider_registry
from . import results
from .case import Case, torch_dtype
from .check import CHECK_BUDGET_BYTES, Oracle
from .flops import attention_flops, pair_flops, tflops
from .progress import Progress
from .providers.base import Prepared, from_bshd, to_bshd
from .suites import Suite
from .timing import TimerConfig, host_us, median_ms, peak_extra_bytes, time_first_call


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        m = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(exc))
        return "OOM" + (f" (tried to allocate {m[1]})" if m else "")
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300]


@dataclass
class RunConfig:
    suite: Suite
    cases: list[Case]
    providers: list[str]
    modes: tuple[str, ...]
    device: torch.device
    timer: TimerConfig = field(default_factory=TimerConfig)
    meta: dict = field(default_factory=dict)
    out_json: Path | None = None  # rewritten after every provider, so a killed run keeps what it measured
    keep_rows: list[dict] = field(default_factory=list)  # rows of an earlier run this one is merged into
    seed: int = 0
    quiet: bool = False
    check_budget_bytes: int = CHECK_BUDGET_BYTES


@dataclass
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    dout_check: torch.Tensor | None = None


class Runner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rows: list[dict] = []
        # (provider, dtype, headdim, causal) -> (work, label) of the case whose forward ran out of memory
        self._oom: dict[tuple, tuple[int, str]] = {}

    @property
    def needs_grads(self) -> bool:
        return any(m != "fwd" for m in self.cfg.modes)

    def _applies(self, case: Case, name: str) -> bool:
        # suites mixing kinds of case (features: packed sequences, windows, plain) may say which provider
        # belongs to which; a pair that does not apply gets no row at all, unlike a skip
        applies = getattr(self.cfg.suite, "applies", None)
        return applies is None or bool(applies(case, name))

    def run(self) -> dict:
        cfg = self.cfg
        total = sum(self._applies(c, n) for c in cfg.cases for n in cfg.providers)
        progress = Progress(total, f"suite {cfg.suite.name}", quiet=cfg.quiet)
        try:
            for case in cfg.cases:
                self._run_case(case, progress)
        finally:
            progress.close()
        # rows a suite measures beside its sweep rather than per provider and case (fp8: the accuracy of
        # each quantisation recipe against the unquantised inputs)
        extra_rows = getattr(cfg.suite, "extra_rows", None)
        if extra_rows is not None:
            self.rows.extend(extra_rows(cfg))
            self._save()
        return self.document()

    def document(self) -> dict:
        rows = results.merge_rows(self.cfg.keep_rows, self.rows, self.cfg.suite.key_fields)
        # fields that compare rows with each other (features: varlen vs equal lengths) need them all
        annotate = getattr(self.cfg.suite, "annotate", None)
        if annotate is not None:
            annotate(rows)
        return {"meta": self.cfg.meta, "rows": rows}

    def _save(self) -> None:
        if self.cfg.out_json is not None:
            results.write(self.cfg.out_json, self.document())

    def _make_inputs(self, case: Case) -> _Inputs:
        gen = torch.Generator(device=self.cfg.device).manual_seed(self.cfg.seed)
        dtype, dev = torch_dtype(case.dtype), self.cfg.device

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=dev, dtype=dtype)

        q_shape = (case.batch, case.seqlen_q, case.nheads, case.headdim)
        k_shape = (case.batch, case.seqlen_k, case.nheads_k, case.headdim)
        v_shape = (case.batch, case.seqlen_k, case.nheads_k, case.headdim_v)
        out_shape = (case.batch, case.seqlen_q, case.nheads, case.headdim_v)
        return _Inputs(randn(*q_shape), randn(*k_shape), randn(*v_shape), randn(*out_shape))

    def _run_case(self, case: Case, progress: Progress) -> None:
        names = [n for n in self.cfg.providers if self._applies(case, n)]
        if not names:
            return
        inputs = self._make_inputs(case)
        oracle: Oracle | None = None
        oracle_error: str | None = None
        for name in names:
            rows = {m: results.new_row(self.cfg.suite.name, name, m, case) for m in self.cfg.modes}
            skip = self._skip_reason(case, name)
            if skip is None and oracle is None and oracle_error is None:
                try:
                    # a suite whose masks the dense oracle cannot know (sparse) brings its own
                    make_oracle = getattr(self.cfg.suite, "oracle", None) or Oracle
                    oracle = make_oracle(
                        case,
                        inputs.q,
                        inputs.k,
                        inputs.v,
                        inputs.dout,
                        grads=self.needs_grads,
                        budget_bytes=self.cfg.check_budget_bytes,
                    )
                    inputs.dout_check = oracle.masked_dout(inputs.dout)
                except Exception as exc:  # noqa: BLE001 - the reason goes into every row of this case
                    oracle_error = f"could not check: the oracle failed with {describe_error(exc)}"
            if skip is not None or oracle_error is not None:
                for row in rows.values():
                    row["error"] = skip or oracle_error
            else:
                self._run_provider(case, name, inputs, oracle, rows)
            self.rows.extend(rows.values())
            self._save()
            progress.step(f"{name:<15} {case.label()} | " + " | ".join(_summary(r) for r in rows.values()))
            self._release()

    def _skip_reason(self, case: Case, name: str) -> str | None:
        reason = self.cfg.suite.skip(case, name)
        if reason:
            return reason
        oom = self._oom.get((name, case.dtype, case.headdim, case.causal))
        if oom is not None and case.work >= oom[0]:
            return f"skipped: out of memory already at a smaller size ({oom[1]})"
        return None

    def _release(self) -> None:
        if self.cfg.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def _run_provider(self, case: Case, name: str, inputs: _Inputs, oracle: Oracle, rows: dict) -> None:
        def fail_all(message: str) -> None:
            for row in rows.values():
                row["error"] = message

        try:
            prepared = provider_registry.get(name).setup(case, inputs.q, inputs.k, inputs.v)
        except Exception as exc:  # noqa: BLE001 - a provider that cannot run is a result, not a crash
            fail_all(describe_error(exc))
            return
        for row in rows.values():
            row.update(prepared.info)
        try:
            with prepared.context():
                self._check_and_time(case, name, prepared, inputs, oracle, rows)
        except Exception as exc:  # noqa: BLE001
            fail_all(describe_error(exc))

    def _check_and_time(
        self, case: Case, name: str, prep: Prepared, inputs: _Inputs, oracle: Oracle, rows: dict
    ) -> None:
        dev, layout = self.cfg.device, prep.layout
        if prep.oracle is not None:
            try:
                oracle = prep.oracle(self.cfg.check_budget_bytes)
            except Exception as exc:  # noqa: BLE001 - the reason goes into every row of this provider
                for row in rows.values():
                    row["error"] = f"could not check: the oracle failed with {describe_error(exc)}"
                return
        try:
            out, fwd_s = time_first_call(prep.fwd, dev)
        except torch.OutOfMemoryError:
            self._oom[(name, case.dtype, case.headdim, case.causal)] = (case.work, case.label())
            raise
        grads, bwd_s, bwd_error = None, None, None
        if self.needs_grads:
            dout_check = from_bshd(inputs.dout_check, layout)
            try:
                grads, bwd_s = time_first_call(
                    partial(torch.autograd.grad, out, prep.leaves, dout_check), dev
                )
            except Exception as exc:  # noqa: BLE001 - forward rows still count when only backward fails
                bwd_error = describe_error(exc)
        verdict = oracle.check(
            to_bshd(out, layout), None if grads is None else [to_bshd(g, layout) for g in grads]
        )
        del out, grads
        first = {"fwd": fwd_s, "bwd": bwd_s, "fwd+bwd": None if bwd_s is None else fwd_s + bwd_s}
        for mode, row in rows.items():
            row["checked_on"] = oracle.checked_on
            row["max_abs_err"], row["rel_err"] = verdict.err_for(mode)
            row["first_call_s"] = first[mode]
            row["error"] = verdict.error_for(mode) or (bwd_error if mode != "fwd" else None)
            if row["error"] is None:
                self._measure(case, mode, prep, inputs, row)

    def _measure(self, case: Case, mode: str, prep: Prepared, inputs: _Inputs, row: dict) -> None:
        dev = self.cfg.device
        try:
            fn = _timed_call(mode, prep, from_bshd(inputs.dout, prep.layout))
            row["peak_mem_bytes"] = peak_extra_bytes(fn, dev)
            row["ms"] = median_ms(fn, dev, self.cfg.timer)
            row["host_us"] = host_us(fn, dev)
        except Exception as exc:  # noqa: BLE001
            row["error"] = describe_error(exc)
            return
        if case.masked:
            # windows and packed sequences: only the pairs that take part count
            flops = pair_flops(case.nheads * case.visible_pairs(), case.headdim, case.headdim_v, mode)
        else:
            flops = attention_flops(
                case.batch, case.nheads, case.seqlen_q, case.seqlen_k, case.headdim, case.causal, mode,
                case.headdim_v,
            )
        row["tflops"] = tflops(flops, row["ms"])


def _timed_call(mode: str, prep: Prepared, dout: torch.Tensor) -> Callable[[], object]:
    if mode == "fwd":
        return prep.fwd
    if mode == "bwd":
        # the forward runs once here, outside the timed region; retain_graph lets every timed call reuse it
        out = prep.fwd()
        return lambda: torch.autograd.grad(out, prep.leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(prep.fwd(), prep.leaves, dout)


def _summary(row: dict) -> str:
    if row["error"]:
        return f"{row['mode']} {row['error'][:70]}"
    rate = f" {row['tflops']:.3g} TFLOP/s" if row["tflops"] is not None else ""
    return f"{row['mode']} {row['ms']:.3g} ms{rate}"
