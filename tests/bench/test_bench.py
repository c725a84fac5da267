"""The bench harness on the CPU: end to end, correctness gating, failure reporting, FLOP counting, reports."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn.bench import cli, providers, report, results, suites
from flashattn.bench.case import Case
from flashattn.bench.check import Oracle, choose_slice
from flashattn.bench.env import slug
from flashattn.bench.flops import attention_flops, visible_pairs
from flashattn.bench.providers.base import Prepared, Provider, make_leaves
from flashattn.bench.providers.naive import naive_attention
from flashattn.bench.runner import RunConfig, Runner
from flashattn.bench.timing import TimerConfig

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
REQUIRED = set(results.ROW_FIELDS)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(case: Case, names: list[str], modes=("fwd", "bwd", "fwd+bwd"), **kw) -> list[dict]:
    cfg = RunConfig(
        suites.get("cpu"),
        [case],
        names,
        tuple(modes),
        torch.device("cpu"),
        TimerConfig.quick(),
        quiet=True,
        **kw,
    )
    return Runner(cfg).run()["rows"]


def _by(rows: list[dict], provider: str) -> dict[str, dict]:
    return {r["mode"]: r for r in rows if r["provider"] == provider}


@pytest.fixture
def fake_provider():
    """Registers providers for one test and removes them afterwards."""
    names = []

    def add(name, setup):
        providers.register(Provider(name, setup, "test double"))
        names.append(name)

    yield add
    for name in names:
        providers.unregister(name)


CASE = Case(batch=2, nheads=4, nheads_k=2, seqlen_q=40, seqlen_k=40, headdim=16, causal=True, dtype="float32")


# -- FLOP counting


def test_flops_by_hand():
    assert attention_flops(2, 3, 128, 128, 64, causal=False) == 4 * 2 * 3 * 128 * 128 * 64
    # square causal keeps the papers' convention: exactly half
    assert attention_flops(2, 3, 128, 128, 64, causal=True) == 2 * 2 * 3 * 128 * 128 * 64
    # sq=2, sk=5 bottom-right: rows see 4 and 5 keys
    assert visible_pairs(2, 5, causal=True) == 9
    assert attention_flops(1, 1, 2, 5, 1, causal=True) == 36
    # sq=5, sk=2: rows 0-2 see nothing, row 3 one key, row 4 two
    assert visible_pairs(5, 2, causal=True) == 3
    assert attention_flops(1, 2, 5, 2, 8, causal=True, mode="bwd") == 4 * 2 * 3 * 8 * 2.5
    assert attention_flops(1, 2, 5, 2, 8, causal=False, mode="fwd+bwd") == 4 * 2 * 10 * 8 * 3.5


@pytest.mark.parametrize("sq,sk", [(1, 7), (3, 17), (17, 3), (64, 100), (100, 64)])
def test_visible_pairs_matches_the_mask(sq, sk):
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    assert visible_pairs(sq, sk, causal=True) == keep.sum().item()


# -- end to end


def test_cpu_suite_end_to_end(tmp_path, capsys):
    names = "naive,sdpa-math,flashattn"
    args = _parse(
        "--suite", "cpu", "--quick", "--seqlens", "48", "--out", str(tmp_path), "--providers", names
    )
    assert cli.run(args) == 0
    doc = json.loads((tmp_path / "cpu.json").read_text())
    for key in ("gpu", "torch", "triton", "cudnn", "git_sha", "command", "date"):
        assert key in doc["meta"]
    assert len(doc["rows"]) == 2 * 3 * 3  # causal or not x providers x modes
    for row in doc["rows"]:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["mode"] in ("fwd", "bwd", "fwd+bwd")
    for row in (r for r in doc["rows"] if r["provider"] in ("naive", "sdpa-math")):
        assert row["error"] is None, row["error"]
        assert row["ms"] > 0 and row["tflops"] > 0 and row["first_call_s"] > 0
        assert row["max_abs_err"] < 1e-4 and "batch 0" in row["checked_on"]
    md = (tmp_path / "cpu.md").read_text()
    assert "## fwd: ms" in md and "| naive | sdpa-math | flashattn |" in md
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert ("cpu-fwd-tflops.png" in pngs) == HAS_MPL
    assert "suite cpu" in capsys.readouterr().out


def test_merge_keeps_rows_not_measured_again(tmp_path):
    common = ("--suite", "cpu", "--quick", "--out", str(tmp_path), "--providers", "naive", "--modes", "fwd")
    assert cli.run(_parse(*common, "--seqlens", "32", "--quiet", "--no-plots")) == 0
    assert cli.run(_parse(*common, "--seqlens", "48", "--quiet", "--no-plots", "--merge")) == 0
    doc = results.load(tmp_path / "cpu.json")
    assert sorted({r["seqlen_q"] for r in doc["rows"]}) == [32, 48]
    assert len(doc["meta"]["earlier_runs"]) == 1


def test_add_providers_extends_the_list(tmp_path):
    common = ("--suite", "cpu", "--quick", "--seqlens", "32", "--causal", "no", "--out", str(tmp_path),
              "--modes", "fwd", "--quiet", "--no-plots")
    assert cli.run(_parse(*common, "--providers", "naive", "--add-providers", "sdpa-math,naive")) == 0
    doc = results.load(tmp_path / "cpu.json")
    assert doc["meta"]["providers"] == ["naive", "sdpa-math"]
    assert {r["provider"] for r in doc["rows"]} == {"naive", "sdpa-math"}


# -- correctness gating and failures


def test_wrong_provider_is_flagged_and_not_timed(fake_provider):
    calls = []

    def setup(case, q, k, v):
        leaves = make_leaves(q, k, v, "bhsd")

        def fwd():
            calls.append(1)
            return naive_attention(*leaves, causal=case.causal) * 1.01

        return Prepared(fwd=fwd, leaves=leaves, layout="bhsd")

    fake_provider("test-wrong", setup)
    rows = _by(_run(CASE, ["test-wrong", "naive"]), "test-wrong")
    for row in rows.values():
        assert row["error"].startswith("wrong result"), row["error"]
        assert row["ms"] is None and row["tflops"] is None
    assert len(calls) == 1  # the checked call only: nothing was timed


def test_wrong_gradient_fails_backward_modes_only(fake_provider):
    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.05

    def setup(case, q, k, v):
        leaves = make_leaves(q, k, v, "bhsd")
        qh, kh, vh = leaves
        return Prepared(
            fwd=lambda: naive_attention(qh, ScaleGrad.apply(kh), vh, causal=case.causal),
            leaves=leaves,
            layout="bhsd",
        )

    fake_provider("test-badgrad", setup)
    rows = _by(_run(CASE, ["test-badgrad"]), "test-badgrad")
    assert rows["fwd"]["error"] is None and rows["fwd"]["ms"] > 0
    for mode in ("bwd", "fwd+bwd"):
        assert "wrong result" in rows[mode]["error"] and "dk" in rows[mode]["error"]
        assert rows[mode]["ms"] is None


def test_failing_providers_are_reported_and_the_run_goes_on(fake_provider):
    def refuses(case, q, k, v):
        raise RuntimeError("No available kernel for this shape")

    def breaks_on_call(case, q, k, v):
        leaves = make_leaves(q, k, v, "bshd")

        def fwd():
            raise ValueError("boom")

        return Prepared(fwd=fwd, leaves=leaves)

    fake_provider("test-refuses", refuses)
    fake_provider("test-breaks", breaks_on_call)
    rows = _run(CASE, ["test-refuses", "test-breaks", "naive"])
    assert all(
        r["error"] == "RuntimeError: No available kernel for this shape"
        for r in _by(rows, "test-refuses").values()
    )
    assert all(r["error"] == "ValueError: boom" for r in _by(rows, "test-breaks").values())
    assert all(r["error"] is None and r["ms"] > 0 for r in _by(rows, "naive").values())


def test_sliced_check_is_exact_for_causal_with_more_keys():
    """Row blocks of a bottom-right causal problem with sq < sk, checked on a slice, pass when correct."""
    case = Case(
        batch=2, nheads=4, nheads_k=2, seqlen_q=300, seqlen_k=400, headdim=16, causal=True, dtype="float32"
    )
    budget = 8 * 400 * 2 * 80  # room for 80 rows of two fp64 score matrices: two blocks of 40
    slc = choose_slice(case, budget_bytes=budget)
    assert (slc.heads_q, slc.heads_k, slc.row_blocks) == (2, 1, ((0, 40), (260, 300)))
    rows = _run(case, ["naive", "sdpa-math"], check_budget_bytes=budget)
    assert rows[0]["checked_on"].startswith("batch 0, heads 0-1 (kv heads 0-0), q rows 0-39 & 260-299 of 300")
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]


def test_oracle_catches_errors_outside_the_checked_heads():
    case = Case(
        batch=2, nheads=4, nheads_k=4, seqlen_q=24, seqlen_k=24, headdim=8, causal=False, dtype="float32"
    )
    q, k, v, dout = (torch.randn(2, 24, 4, 8) for _ in range(4))
    oracle = Oracle(case, q, k, v, dout, grads=True)
    dout_check = oracle.masked_dout(dout)
    leaves = [x.requires_grad_() for x in make_leaves(q, k, v, "bhsd")]
    out = naive_attention(*leaves)
    grads = [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, dout_check.transpose(1, 2))]
    assert oracle.check(out.transpose(1, 2), grads).bwd_error is None
    grads[1] = grads[1].clone()
    grads[1][1, 0, 3] += 1.0  # a gradient where dout is zero must be zero
    assert "where dout is zero" in oracle.check(out.transpose(1, 2), grads).bwd_error


# -- reports


def _gpu_doc() -> dict:
    rows = []
    for d in (64, 128):
        for n in (1024, 16384):
            for p, tf in (("flashattn", 400.0), ("flex", 320.0), ("sdpa-flash", 200.0), ("naive", 30.0)):
                case = Case(16384 // n, 2048 // d, 2048 // d, n, n, d, True, "bfloat16")
                row = results.new_row("train", p, "fwd", case)
                if p == "naive" and n > 8192:
                    row["error"] = "skipped: naive materialises the scores"
                else:
                    row.update(ms=1.0, tflops=tf, peak_mem_bytes=2**30, max_abs_err=1e-3, host_us=100.0)
                rows.append(row)
    rows[0]["host_us"] = 900.0  # flashattn at d=64, N=1K: host time close to the measured 1 ms
    meta = {"gpu": "NVIDIA H200", "suite": "train", "providers": ["flashattn", "flex", "sdpa-flash", "naive"]}
    return {"meta": meta, "rows": rows}


def test_report_renders_fabricated_gpu_rows(tmp_path):
    written = report.render(_gpu_doc(), tmp_path)
    md = (tmp_path / "train.md").read_text()
    assert "## fwd: TFLOP/s" in md
    assert "| d | N | b | h | flashattn | flex | sdpa-flash | naive |" in md
    assert "| 64 | 16384 | 1 | 32 | 400 | 320 | 200 | – |" in md
    assert "- flashattn / flex: 1.25x geomean (1.25x to 1.25x, 4 shapes)" in md
    assert "naive: skipped: naive materialises the scores (2 shapes)" in md
    assert "- flashattn fwd d=64 N=1024 causal: 1000 us measured, host 900 us per call" in md
    assert md.count("us measured, host") == 1  # the rows with host time far below their time are not listed
    assert any(p.name == "train-fwd-tflops.png" for p in written) == HAS_MPL


def test_memory_report_and_cli_rerender(tmp_path):
    rows = []
    for n in (1024, 4096, 16384, 65536):
        case = Case(1, 16, 16, n, n, 128, True, "bfloat16")
        for p in ("flashattn", "naive"):
            row = results.new_row("memory", p, "fwd+bwd", case)
            if p == "naive" and n == 65536:
                row["error"] = "OOM (tried to allocate 128.00 GiB)"
            else:
                row.update(
                    ms=1.0, tflops=100.0, peak_mem_bytes=n * n * (16 if p == "naive" else 0) + n * 4096
                )
            rows.append(row)
    path = tmp_path / "memory.json"
    results.write(path, {"meta": {"gpu": "NVIDIA H200", "suite": "memory"}, "rows": rows})
    assert cli.run(_parse("--report", str(path))) == 0
    md = (tmp_path / "memory.md").read_text()
    assert "## fwd+bwd: peak extra memory (GiB)" in md and "| 65536 | 0.25 | OOM |" in md
    assert (tmp_path / "memory-fwdbwd-peak_mem_bytes.png").exists() == HAS_MPL


def test_compare_two_runs(tmp_path, capsys):
    a, b = _gpu_doc(), _gpu_doc()
    for row in b["rows"]:
        if row["provider"] == "flashattn":
            row["ms"] = 0.5
    results.write(tmp_path / "a.json", a)
    results.write(tmp_path / "b.json", b)
    assert cli.run(_parse("--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))) == 0
    assert "flashattn fwd: geomean speedup 2.00x over 4 shapes" in capsys.readouterr().out


# -- small pieces


def test_grid_derives_batch_and_heads():
    grid = suites.get("train").grid(False).override(seqlens=(1024, 32768), headdims=(128,), causal=(True,))
    assert [(c.batch, c.nheads, c.seqlen_q) for c in grid.cases()] == [(16, 16, 1024), (1, 16, 32768)]
    fixed = grid.override(batch=3, nheads=5)
    assert {(c.batch, c.nheads) for c in fixed.cases()} == {(3, 5)}


def test_slug():
    assert slug("NVIDIA H200") == "h200"
    assert slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert slug("cpu") == "cpu"


def test_reports_degrade_without_rich_or_matplotlib(tmp_path, monkeypatch, capsys):
    for name in ("matplotlib", "matplotlib.figure", "rich", "rich.console", "rich.table"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.warns(UserWarning, match="matplotlib"):
        written = report.render(_gpu_doc(), tmp_path)
    assert [p.name for p in written] == ["train.md"]
    report.print_tables(_gpu_doc())
    out = capsys.readouterr().out
    assert "fwd: TFLOP/s" in out and "flashattn / flex: 1.25x geomean" in out


def test_report_combines_parts_of_a_sweep(tmp_path):
    doc = _gpu_doc()
    part1 = {"meta": doc["meta"], "rows": [r for r in doc["rows"] if r["headdim"] == 64]}
    part2 = {"meta": doc["meta"], "rows": [r for r in doc["rows"] if r["headdim"] == 128]}
    results.write(tmp_path / "p1" / "train.json", part1)
    results.write(tmp_path / "p2" / "train.json", part2)
    out = tmp_path / "all"
    args = _parse("--report", str(tmp_path / "p1" / "train.json"), str(tmp_path / "p2" / "train.json"))
    args.out, args.no_plots = out, True
    assert cli.run(args) == 0
    combined = results.load(out / "train.json")
    assert len(combined["rows"]) == len(doc["rows"]) and len(combined["meta"]["parts"]) == 2


# -- --ncu: one profiled child per measured row


def test_ncu_adds_dram_bytes_per_row(tmp_path):
    """A stand-in ncu runs the real child command (which rebuilds the row's provider and case and calls it;
    on the CPU there is nothing to profile) and prints a fixed two-kernel report: the row gets its sums, the
    markdown a DRAM table, and a failing child an ncu_error instead."""
    from utils import NCU_LONG

    fake = tmp_path / "ncu"
    fake.write_text(
        f"#!{sys.executable}\nimport subprocess, sys\nargs = sys.argv[1:]\n"
        "child = args[args.index('--target-processes') + 2:]\n"
        "rc = subprocess.run(child).returncode\n"
        f"print({NCU_LONG!r}) if rc == 0 else sys.exit(rc)\n"
    )
    fake.chmod(0o755)
    common = ("--suite", "cpu", "--quick", "--seqlens", "32", "--causal", "no", "--out", str(tmp_path),
              "--quiet", "--no-plots", "--ncu", str(fake))
    assert cli.run(_parse(*common, "--providers", "naive,flashattn", "--modes", "fwd")) == 0
    doc = results.load(tmp_path / "cpu.json")
    assert doc["meta"]["ncu"].startswith(f"{fake} --clock-control none")
    measured = [r for r in doc["rows"] if r["ms"] is not None]
    assert {r["provider"] for r in measured} == {"naive", "flashattn"}
    for row in measured:
        assert row["ncu_kernels"] == 2 and "ncu_error" not in row
        assert row["dram_bytes"] == pytest.approx(402653184 + 138412032 + 268.44e6 + 4194.30e3)
    md = (tmp_path / "cpu.md").read_text()
    assert "## fwd: DRAM traffic, one call (GB, Nsight Compute)" in md


def test_ncu_child_failure_is_recorded(tmp_path):
    from flashattn.bench import ncu

    fake = tmp_path / "ncu"
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('==ERROR== profiling is not permitted')\n"
                    "sys.exit(1)\n")
    fake.chmod(0o755)
    rows = [{"provider": "naive", "mode": "fwd", "ms": 1.0, "error": None}, {"ms": None, "error": "OOM"}]
    ncu.annotate_rows(rows, str(fake), progress=lambda m: None)
    assert "profiling is not permitted" in rows[0]["ncu_error"] and "dram_bytes" not in rows[0]
    assert "ncu_error" not in rows[1]  # rows without a timing are not profiled


def test_forward_key_providers_take_the_q_buffers_that_fit():
    # the Gluon forward's A/B of key steps: one Q buffer (no deferred release) where two do not fit
    from flashattn.backends.triton import routes
    from flashattn.bench.providers.ours import _forward_keys

    spec = routes.Spec(batch=2, nheads=8, nheads_k=8, seqlen_q=8192, seqlen_k=8192, headdim=256,
                       headdim_v=256, window=(-1, 0))
    wide = _forward_keys(64, 2)(spec)
    assert (wide.tiles.block_n, wide.q_buffers, wide.defer_release, wide.half_diag) == (64, 1, False, False)
    narrow = _forward_keys(32, 2)(spec)
    assert (narrow.tiles.block_n, narrow.q_buffers, narrow.defer_release) == (32, 2, True)
    d128 = _forward_keys(128, 2)(dataclasses.replace(spec, headdim=128, headdim_v=128))
    assert (d128.q_buffers, d128.half_diag) == (2, True)
    assert isinstance(_forward_keys(64, 2)(dataclasses.replace(spec, dropout=True)), routes.TritonForward)
    # the qk_ahead providers: 128-row tiles (two consumers) of their key steps, no half step, qk_ahead on
    ahead = _forward_keys(64, 2, 128, qk_ahead=True)(dataclasses.replace(spec, headdim=128, headdim_v=128))
    assert (ahead.tiles.block_m, ahead.tiles.block_n, ahead.half_diag) == (128, 64, False) and ahead.qk_ahead
    assert not routes.forward_route(dataclasses.replace(spec, headdim=128, headdim_v=128)).qk_ahead


def test_the_dsplit_provider_takes_the_64_key_backward_where_the_default_is_the_128_key_one():
    from flashattn.backends.triton import routes
    from flashattn.bench.providers.ours import _dsplit_backward

    spec = routes.Spec(batch=2, nheads=16, nheads_k=16, seqlen_q=8192, seqlen_k=8192, headdim=192,
                       headdim_v=128, window=(-1, 0))
    assert routes.backward_route(spec).wide_keys
    route = _dsplit_backward(spec)
    assert (route.wide_keys, route.d_qk) == (False, 192)
    # elsewhere the default: d = 256 on the d-split kernel already, dv 64 beside 192 (not its pair), d 128
    for other in (dict(headdim=256), dict(headdim_v=64), dict(headdim=128)):
        spec_o = dataclasses.replace(spec, **other)
        assert _dsplit_backward(spec_o) == routes.backward_route(spec_o)


def test_host_time_is_a_gpu_only_field():
    from flashattn.bench.timing import host_us

    assert host_us(lambda: None, torch.device("cpu")) is None


@pytest.mark.parametrize("name", ["flashattn-triton", "flashattn-triton-bwd", "flashattn-ptr",
                                  "flashattn-headmajor", "flashattn-ws-tiles", "flashattn-bwd-split4",
                                  "flashattn-fwd-k64", "flashattn-bwd-dsplit"])
def test_route_providers_compute_the_same_attention(name):
    # the A/B providers time the library on other routes: same function, checked like any provider
    from flashattn.bench import providers
    from flashattn.bench.case import Case
    from flashattn.reference import attention_ref

    case = Case(1, 4, 2, 70, 70, 32, True, "fp32", {})
    q, k, v = (torch.randn(1, 70, h, 32) for h in (4, 2, 2))
    if not flashattn_config.INTERPRET and not torch.cuda.is_available():
        pytest.skip("the routes' launchers need CUDA or TRITON_INTERPRET=1")
    with flashattn_config.use_backend("triton"):
        prepared = providers.get(name).setup(case, q, k, v)
        with prepared.context():
            out = prepared.fwd()
            grads = torch.autograd.grad(out, prepared.leaves, torch.ones_like(out))
    ref = attention_ref(q.double(), k.double(), v.double(), causal=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["flashattn-paged", "flashattn-paged-gather"])
def test_paged_providers_compute_the_packed_attention(name):
    # paged prefill (forward, no gradient) on a packed case: each document's keys on pages of their own
    from flashattn.bench import providers
    from flashattn.bench.case import Case
    from flashattn.reference import attention_ref

    lengths = (70, 1, 186)
    total = sum(lengths)
    case = Case(1, 4, 2, total, total, 32, True, "fp32", {"lengths": lengths})
    q, k, v = (torch.randn(1, total, h, 32) for h in (4, 2, 2))
    if not flashattn_config.INTERPRET and not torch.cuda.is_available():
        pytest.skip("the launchers need CUDA or TRITON_INTERPRET=1")
    with flashattn_config.use_backend("triton"):
        prepared = providers.get(name).setup(case, q, k, v)
        out = prepared.fwd()
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        ref, _ = attention_ref(q[:, rows].double(), k[:, rows].double(), v[:, rows].double(), causal=True)
        torch.testing.assert_close(out[:, rows].double(), ref, atol=1e-4, rtol=1e-4)
        start += n

