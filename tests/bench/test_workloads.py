"""The `workloads` bench suite on the CPU: its cases, which providers run which, the FLOPs of a v head dim of
its own, the oracle with softcap / sink / dv, the speedup annotation, and an end-to-end smoke run of the
suite with flashattn (torch backend), a stand-in FA4 and sdpa-cudnn."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn.bench import cli, results, suites
from flashattn.bench.case import Case, window_pairs
from flashattn.bench.check import Oracle
from flashattn.bench.flops import MODE_FACTOR, attention_flops, pair_flops
from flashattn.bench.suites.features import packed_lengths
from flashattn.bench.suites.workloads import (
    SPEEDUP_FIELD,
    TILE,
    WorkloadGrid,
    annotate,
    build_cases,
    longtail_lengths,
    skip,
)
from flashattn.reference import attention_ref, attention_ref_varlen

SUITE = suites.get("workloads")

# name -> (batch, nheads, nheads_k, N, headdim, headdim_v, causal, window, softcap, sink)
EXPECTED = {
    "docs-longtail": (1, 16, 16, 16384, 128, 128, True, (-1, -1), 0.0, False),
    "docs-4": (1, 16, 16, 16384, 128, 128, True, (-1, -1), 0.0, False),
    "window-4095-0": (1, 16, 16, 16384, 128, 128, True, (4095, 0), 0.0, False),
    "window-1023-0": (1, 16, 16, 16384, 128, 128, True, (1023, 0), 0.0, False),
    "window-1024-1024": (1, 16, 16, 16384, 128, 128, False, (1024, 1024), 0.0, False),
    "softcap-d128": (2, 16, 16, 8192, 128, 128, True, (-1, -1), 50.0, False),
    "softcap-d256": (2, 8, 8, 8192, 256, 256, True, (-1, -1), 50.0, False),
    "sink": (2, 32, 32, 8192, 64, 64, True, (-1, -1), 0.0, True),
    "sink-window-128": (2, 32, 32, 8192, 64, 64, True, (128, 0), 0.0, True),
    "gqa-32-8": (2, 32, 8, 8192, 128, 128, True, (-1, -1), 0.0, False),
    "mqa-32-1": (2, 32, 1, 8192, 128, 128, True, (-1, -1), 0.0, False),
    "d256-full": (2, 8, 8, 8192, 256, 256, False, (-1, -1), 0.0, False),
    "d256-causal": (2, 8, 8, 8192, 256, 256, True, (-1, -1), 0.0, False),
    "d192-dv128": (2, 16, 16, 8192, 192, 128, True, (-1, -1), 0.0, False),
}
# the workloads SDPA has an argument for: plain attention apart from GQA and head dims
SDPA_RUNS = {"gqa-32-8", "mqa-32-1", "d256-full", "d256-causal", "d192-dv128"}
ROW_FIELDS = {"workload", "window_left", "window_right", "lengths", "softcap", "sink", "headdim_v"}


def _shape(c: Case):
    return (c.batch, c.nheads, c.nheads_k, c.seqlen_q, c.headdim, c.headdim_v, c.causal, c.window, c.softcap,
            c.has_sink)


# -- the cases


def test_default_cases_are_exactly_the_workloads():
    cases = SUITE.build_cases(SUITE.grid(False))
    assert [c.extra["workload"] for c in cases] == list(EXPECTED)
    for c in cases:
        assert _shape(c) == EXPECTED[c.extra["workload"]], c.label()
        assert c.dtype == "bfloat16" and c.seqlen_q == c.seqlen_k
        assert ROW_FIELDS <= set(results.new_row("workloads", "flashattn", "fwd", c))
    docs = {c.extra["workload"]: c.lengths for c in cases if c.lengths is not None}
    assert set(docs) == {"docs-longtail", "docs-4"}
    assert docs["docs-4"] == packed_lengths(16384) == (394, 4808, 3641, 7541)
    tail = docs["docs-longtail"]
    assert sum(tail) == 16384 and len(tail) == 19
    assert all(128 <= n <= 4096 and n % 128 and n % TILE for n in tail), tail
    # long-tailed toward short: most documents are short, yet the long ones hold most of the tokens
    assert sum(n < 1024 for n in tail) > len(tail) / 2
    assert sum(n for n in tail if n >= 1024) > 16384 / 2
    assert min(tail) < 256 and max(tail) > 2048
    assert SUITE.modes == ("fwd", "bwd") and SUITE.providers == ("flashattn", "fa4", "sdpa-cudnn")


def test_quick_keeps_one_workload_of_each_kind():
    grid = SUITE.grid(True)
    assert isinstance(grid, WorkloadGrid) and grid.quick
    names = [c.extra["workload"] for c in SUITE.build_cases(grid)]
    assert names == ["docs-longtail", "window-4095-0", "softcap-d128", "sink", "gqa-32-8", "d256-full",
                     "d192-dv128"]


def test_small_overrides_scale_the_windows_and_the_packing():
    grid = SUITE.grid(False).override(seqlens=(128,), tokens=512)
    cases = build_cases(grid)
    names = [c.extra["workload"] for c in cases]
    assert names[2:5] == ["window-127-0", "window-31-0", "window-32-32"]
    assert "sink-window-2" in names
    for c in cases:
        if c.lengths is not None:
            assert (c.batch, c.seqlen_q) == (1, 512) and sum(c.lengths) == 512
        elif c.window != (-1, -1) and not c.has_sink:
            assert (c.batch, c.seqlen_q) == (1, 512)
        else:
            assert (c.batch, c.seqlen_q) == (2, 128)
    # --causal no: the two non-causal workloads only
    grid = SUITE.grid(False).override(causal=(False,))
    assert [c.extra["workload"] for c in build_cases(grid)] == ["window-1024-1024", "d256-full"]


@pytest.mark.parametrize(
    "override", [{"headdims": (64,)}, {"batch": 2}, {"nheads": 8}, {"hidden": 2048}, {"nheads_k": 2}]
)
def test_overrides_the_workloads_fix_are_refused(override):
    with pytest.raises(ValueError, match="fixes batch, heads and head dims"):
        build_cases(SUITE.grid(False).override(**override))


@pytest.mark.parametrize("tokens", [256, 512, 1000, 16384, 65536])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_longtail_lengths_sum_exactly_within_range(tokens, seed):
    lengths = longtail_lengths(tokens, seed)
    assert sum(lengths) == tokens
    lo, hi = max(1, tokens // 128), max(2 * max(1, tokens // 128), tokens // 4)
    assert all(lo <= n <= hi for n in lengths), lengths
    assert all(n % TILE for n in lengths), lengths
    assert longtail_lengths(tokens, seed) == lengths  # deterministic


def test_providers_that_apply_to_each_workload():
    for c in SUITE.build_cases(SUITE.grid(False)):
        name = c.extra["workload"]
        assert skip(c, "flashattn") is None and skip(c, "fa4") is None, name
        for other in ("sdpa-cudnn", "sdpa-flash", "flex", "naive", "flashattn-triton"):
            reason = skip(c, other)
            assert (reason is None) == (name in SDPA_RUNS), (name, other, reason)
        reason = skip(c, "sdpa-cudnn")
        if name.startswith("docs"):
            assert "packed documents" in reason
        if name.startswith("window") or name == "sink-window-128":
            assert "sliding window" in reason
        if name.startswith("softcap"):
            assert "softcap" in reason
        if name.startswith("sink"):
            assert "learnable sink" in reason
        assert reason is None or reason.startswith("skipped: sdpa-cudnn has no argument for")


def test_sink_values_are_fixed_per_case():
    c = Case(2, 4, 4, 16, 16, 8, True, "float32", {"sink": True})
    a, b = c.learnable_sink("cpu"), c.learnable_sink("cpu", requires_grad=True)
    assert a.shape == (4,) and a.dtype == torch.float32 and torch.equal(a, b) and b.requires_grad
    assert a.abs().max() > 0.1
    assert Case(2, 4, 4, 16, 16, 8, True, "float32").learnable_sink("cpu") is None


# -- FLOPs


def test_flops_with_a_v_head_dim_of_its_own():
    # FA's convention: QKᵀ over d, PV over dv, 2 flops per multiply-add; d = dv gives the usual 4·pairs·d
    assert pair_flops(10, 192, 128) == 2 * 10 * (192 + 128)
    assert pair_flops(10, 64) == 4 * 10 * 64 and pair_flops(10, 64, 64, "bwd") == 4 * 10 * 64 * 2.5
    assert attention_flops(2, 16, 8192, 8192, 192, True, "fwd", 128) == 2 * 2 * 16 * 8192**2 / 2 * 320
    assert attention_flops(2, 3, 128, 128, 64, False) == 4 * 2 * 3 * 128 * 128 * 64


def test_window_workloads_count_the_exact_band():
    cases = {c.extra["workload"]: c for c in SUITE.build_cases(SUITE.grid(False))}
    # (4095, 0) causal at 16K: row i sees min(i + 1, 4096) keys
    assert cases["window-4095-0"].visible_pairs() == 4096 * 4097 / 2 + (16384 - 4096) * 4096
    assert cases["window-1024-1024"].visible_pairs() == window_pairs(16384, 16384, False, (1024, 1024))
    assert cases["sink-window-128"].visible_pairs() == 2 * (129 * 130 / 2 + (8192 - 129) * 129)


# -- the oracle with softcap, sink and dv


def _verdict(case, provider):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim, generator=g)
    k = torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim, generator=g)
    v = torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim_v, generator=g)
    dout = torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim_v, generator=g)
    oracle = Oracle(case, q, k, v, dout, grads=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = provider(*leaves).float()
    grads = torch.autograd.grad(out, leaves, oracle.masked_dout(dout))
    return oracle, oracle.check(out, list(grads))


def _ref(case, softcap=None, sink=True):
    def run(q, k, v):
        options = {"softcap": case.softcap if softcap is None else softcap}
        if sink:
            options["learnable_sink"] = case.learnable_sink(q.device)
        return attention_ref(q, k, v, causal=case.causal, window_size=case.window, **options)[0]

    return run


OPTION_CASES = [
    Case(2, 4, 2, 96, 96, 16, True, "float32", {"softcap": 50.0}),
    Case(2, 4, 4, 96, 96, 16, True, "float32", {"sink": True}),
    Case(2, 4, 4, 96, 96, 16, True, "float32", {"sink": True, "window_left": 8, "window_right": 0}),
    Case(2, 4, 4, 96, 96, 24, True, "float32", {"headdim_v": 16}),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: c.label())
def test_oracle_accepts_attention_with_the_options(case):
    oracle, verdict = _verdict(case, _ref(case))
    assert verdict.fwd_error is None and verdict.bwd_error is None, (verdict, oracle.checked_on)
    assert verdict.out_err < 1e-6 and verdict.grad_err < 1e-6
    if case.softcap:
        assert "softcap 50" in oracle.checked_on
    if case.has_sink:
        assert "learnable sink" in oracle.checked_on


@pytest.mark.parametrize("case", OPTION_CASES[:3], ids=lambda c: c.label())
def test_oracle_rejects_attention_without_the_options(case):
    # fp32: softcap 50 moves unit-variance scores by ~1e-4, far above fp32's rounding (in bf16 it is not)
    provider = _ref(case, softcap=0.0) if case.softcap else _ref(case, sink=False)
    _, verdict = _verdict(case, provider)
    assert verdict.fwd_error is not None and verdict.fwd_error.startswith("wrong result")
    assert verdict.bwd_error is not None


# -- annotate: the speedups


def _row(provider, mode, case, ms, error=None):
    row = results.new_row("workloads", provider, mode, case)
    row.update(ms=ms, tflops=1.0 / ms, error=error)
    return row


def test_annotate_gives_each_provider_its_time_over_ours():
    cases = {c.extra["workload"]: c for c in SUITE.build_cases(SUITE.grid(False))}
    docs, gqa = cases["docs-4"], cases["gqa-32-8"]
    rows = [
        _row("flashattn", "fwd", docs, 2.0),
        _row("fa4", "fwd", docs, 3.0),
        _row("flashattn", "bwd", docs, 5.0),
        _row("fa4", "bwd", docs, 4.0),
        _row("flashattn", "fwd", gqa, 1.0),
        _row("fa4", "fwd", gqa, 1.5),
        _row("sdpa-cudnn", "fwd", gqa, 2.5),
        _row("sdpa-cudnn", "bwd", gqa, 3.0, error="wrong result: whatever"),  # not a time to compare
        _row("fa4", "fwd", cases["docs-longtail"], 1.0),  # no flashattn row to compare with
    ]
    annotate(rows)
    got = [r.get(SPEEDUP_FIELD) for r in rows]
    assert got == [None, 1.5, None, 0.8, None, 1.5, 2.5, None, None]
    rows[1]["ms"] = 1.0
    annotate(rows)
    assert rows[1][SPEEDUP_FIELD] == 0.5


# -- end to end on the CPU


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def _install_fake_fa4(monkeypatch) -> list[dict]:
    """flash_attn.cute.interface with FA4's argument names (no **kwargs: a misspelled one is a TypeError),
    its spelling of windows (None = unbounded; a negative side is refused), and the oracle inside."""
    calls: list[dict] = []

    def window(size):
        if any(w is not None and w < 0 for w in size):
            raise ValueError(f"FA4 spells an unbounded window side None, got {size}")
        return tuple(-1 if w is None else w for w in size)

    def sink_ok(sink, h):
        assert sink is None or (sink.shape == (h,) and sink.dtype == torch.float32 and sink.requires_grad)

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                        window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False):
        sink_ok(learnable_sink, q.shape[2])
        calls.append({"varlen": False, "window_size": window_size, "softcap": softcap,
                      "sink": learnable_sink is not None})
        out, lse = attention_ref(q, k, v, causal=causal, window_size=window(window_size), softcap=softcap,
                                 learnable_sink=learnable_sink)
        return out.to(q.dtype), lse

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0):
        assert q.dim() == 3 and max_seqlen_q == max_seqlen_k == int(cu_seqlens_q.diff().max())
        sink_ok(learnable_sink, q.shape[1])
        calls.append({"varlen": True, "window_size": window_size, "softcap": softcap,
                      "sink": learnable_sink is not None})
        out, lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                        window_size=window(window_size), softcap=softcap,
                                        learnable_sink=learnable_sink)
        return out.to(q.dtype), lse

    interface = types.ModuleType("flash_attn.cute.interface")
    interface.flash_attn_func = flash_attn_func
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    package = types.ModuleType("flash_attn")
    package.cute = cute
    for name, module in (("flash_attn", package), ("flash_attn.cute", cute), ("flash_attn.cute.interface",
                                                                             interface)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_workloads_suite_smoke_on_cpu(tmp_path, monkeypatch):
    # the CPU smoke run is about the harness: the torch backend stands in for the kernels
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    calls = _install_fake_fa4(monkeypatch)
    args = _parse(
        "--suite", "workloads", "--device", "cpu", "--quiet", "--no-plots", "--seqlens", "128",
        "--tokens", "512", "--dtype", "fp32", "--providers", "flashattn,fa4,sdpa-cudnn", "--modes", "fwd,bwd",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert cli.run(args) == 0
    rows = json.loads((tmp_path / "workloads.json").read_text())["rows"]
    names = [c.extra["workload"] for c in build_cases(SUITE.grid(False).override(seqlens=(128,), tokens=512))]
    assert len(names) == 14 and len(rows) == 14 * 3 * 2
    by = {(r["workload"], r["provider"], r["mode"]): r for r in rows}
    for name in names:
        for mode in ("fwd", "bwd"):
            for provider in ("flashattn", "fa4"):
                r = by[(name, provider, mode)]
                assert r["error"] is None, (name, provider, mode, r["error"])
                assert r["ms"] > 0 and r["tflops"] > 0 and r["max_abs_err"] < 1e-4
                assert ROW_FIELDS <= set(r)
                # TFLOP/s from the visible pairs, at 2·pairs·(d + dv)
                pairs = window_pairs(r["seqlen_q"], r["seqlen_k"], r["causal"],
                                     (r["window_left"], r["window_right"]))
                if r["lengths"]:
                    pairs = sum(n * n / 2 for n in r["lengths"])
                dims = r["headdim"] + r["headdim_v"]
                flops = 2 * r["batch"] * r["nheads"] * pairs * dims * MODE_FACTOR[mode]
                assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
                if r["softcap"]:
                    assert "softcap 50" in r["checked_on"]
                if r["sink"]:
                    assert "learnable sink" in r["checked_on"]
                if r["lengths"]:
                    assert r["checked_on"].startswith("batch 0 (packed)")
            assert by[(name, "fa4", mode)][SPEEDUP_FIELD] == pytest.approx(
                by[(name, "fa4", mode)]["ms"] / by[(name, "flashattn", mode)]["ms"]
            )
            assert SPEEDUP_FIELD not in by[(name, "flashattn", mode)]
            cudnn = by[(name, "sdpa-cudnn", mode)]
            # on the CPU the cuDNN backend cannot run; what matters is that only the plain workloads try it
            assert cudnn["error"] is not None
            assert cudnn["error"].startswith("skipped") == (name not in SDPA_RUNS), (name, cudnn["error"])
    assert by[("d192-dv128", "flashattn", "fwd")]["headdim_v"] == 128
    # each of our rows names the kernels it timed (the torch backend here), the other providers' none
    ours = [r for r in rows if r["provider"] == "flashattn"]
    assert ours and all((r["route_fwd"], r["route_bwd"]) == ("torch", "torch") for r in ours)
    assert not any("route_fwd" in r for r in rows if r["provider"] != "flashattn")
    # FA4 got the options in its own spelling: varlen for the documents, None for an unbounded side
    assert sum(c["varlen"] for c in calls) > 0 and all(c["window_size"] == (None, None) for c in calls
                                                       if c["varlen"])
    spelled = {(c["window_size"], c["softcap"], c["sink"]) for c in calls}
    assert {((127, 0), 0.0, False), ((32, 32), 0.0, False), ((None, None), 50.0, False), ((2, 0), 0.0, True),
            ((None, None), 0.0, True)} <= spelled
    md = (tmp_path / "workloads.md").read_text()
    assert "## fwd: flashattn speedup" in md and "## bwd: TFLOP/s" in md
    assert "| docs-longtail |" in md and "| d192-dv128 |" in md
    assert "flashattn / fa4:" in md


def test_routes_info_names_the_kernels_of_the_call(monkeypatch):
    # the row fields come from the routing spec of the call as the provider makes it: under the interpreter
    # CPU tensors take the Triton kernels' routes (the Gluon ones need sm90), a forced torch backend its own
    from flashattn.bench.providers.ours import routes_info

    q, k, v = (torch.randn(1, 64, 2, 32) for _ in range(3))
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    assert routes_info(q, k, v, causal=True) == {"route_fwd": "torch", "route_bwd": "torch"}
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    monkeypatch.setattr(flashattn_config, "INTERPRET", True)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    for info in (routes_info(q, k, v, causal=True, window_size=(16, 0)),
                 routes_info(q[0], k[0], v[0], cu_seqlens_q=cu, max_seqlen_q=44, max_seqlen_k=44)):
        assert info == {"route_fwd": "TritonForward", "route_bwd": "TritonBackward"}
