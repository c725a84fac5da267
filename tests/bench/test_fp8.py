"""The `fp8` bench suite on the CPU: its cases, the FP8 providers' quantisation, the check of an FP8 output
against the oracle on its dequantised inputs (a dropped descale fails it), the accuracy measures on hand-made
tensors, the annotations, and end-to-end runs writing JSON and markdown.

Under TRITON_INTERPRET=1 (as CI runs it) the automatic backend runs the Triton kernels interpreted, in
fp16: the tests that are about the real kernel's FP8 rounding use it at tiny shapes; the rest force the torch
backend (the harness is what they test)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import torch
from route_specs import spec as route_spec

from flashattn import config as flashattn_config
from flashattn import fp8
from flashattn.backends.triton import routes
from flashattn.bench import accuracy, cli, providers, results, suites
from flashattn.bench.case import Case
from flashattn.bench.check import FP8_FLOOR, Fp8Oracle
from flashattn.bench.flops import attention_flops
from flashattn.bench.providers.base import Provider
from flashattn.bench.providers.fp8 import (
    RECIPES,
    ROUTE_VARIANTS,
    TILE_VARIANTS,
    Recipe,
    fp8_attention,
    prepare,
)
from flashattn.bench.providers.ours import tiled_route
from flashattn.bench.runner import RunConfig, Runner
from flashattn.bench.suites.fp8 import (
    ACCURACY_MODE,
    GAIN_FIELD,
    SPEEDUP_FIELD,
    accuracy_cases,
    annotate,
    skip,
)
from flashattn.bench.timing import TimerConfig
from flashattn.errors import FlashAttnError

SUITE = suites.get("fp8")
FP8_PROVIDERS = tuple(RECIPES)


def _inputs(case: Case, seed: int = 0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(case.batch, n, h, case.headdim, generator=g).to(dtype)
                 for n, h in ((case.seqlen_q, case.nheads), (case.seqlen_k, case.nheads_k),
                              (case.seqlen_k, case.nheads_k)))


def _case(b=1, h=2, hk=2, n=64, d=32, causal=True, dtype="float16"):
    return Case(b, h, hk, n, n, d, causal, dtype, {"inputs": "normal"})


# -- the cases


def test_default_cases_are_16k_tokens_at_hidden_2048():
    cases = SUITE.build_cases(SUITE.grid(False))
    assert len(cases) == 3 * 5 * 2
    assert {(c.headdim, c.nheads) for c in cases} == {(64, 32), (128, 16), (256, 8)}
    assert {c.seqlen_q for c in cases} == {1024, 2048, 4096, 8192, 16384}
    for c in cases:
        assert c.batch * c.seqlen_q == 16384 and c.nheads * c.headdim == 2048, c.label()
        assert (c.seqlen_k, c.nheads_k, c.dtype, c.extra) == (c.seqlen_q, c.nheads, "bfloat16",
                                                              {"inputs": "normal"})
        assert "inputs" in results.new_row("fp8", "flashattn", "fwd", c)
    assert {c.causal for c in cases} == {False, True}
    assert SUITE.modes == ("fwd",) and SUITE.device == "cuda"
    assert SUITE.providers == ("flashattn-fp8", "flashattn-fp8-rowv", "flashattn-fp8-gluon",
                               "flashattn-fp8-triton", "flashattn-fp8+quant", "flashattn-fp8+rot+quant",
                               "flashattn", "sdpa-cudnn")
    quick = SUITE.build_cases(SUITE.grid(True))
    assert {(c.headdim, c.seqlen_q, c.batch) for c in quick} == {(128, 4096, 4), (128, 16384, 1)}


def test_accuracy_cases_follow_the_sweep():
    cases = accuracy_cases(SUITE.build_cases(SUITE.grid(False)))
    assert [(c.extra["inputs"], c.causal) for c in cases] == [
        ("normal", False), ("normal", True), ("outliers", False), ("outliers", True)]
    shapes = {(c.batch, c.nheads, c.seqlen_q, c.seqlen_k, c.headdim, c.dtype) for c in cases}
    assert shapes == {(1, 16, 4096, 4096, 128, "bfloat16")}
    # a small sweep without d128: its first head dim, its longest N, its causal values
    small = SUITE.build_cases(SUITE.grid(False).override(seqlens=(32, 64), headdims=(16,), hidden=32,
                                                         tokens=64, causal=(True,), dtype="fp16"))
    assert [(c.batch, c.nheads, c.seqlen_q, c.headdim, c.causal, c.dtype) for c in accuracy_cases(small)] == [
        (1, 2, 64, 16, True, "float16")] * 2
    assert accuracy_cases([]) == []


def test_sdpa_cudnn_is_skipped_without_cuda(monkeypatch):
    case = _case()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert skip(case, "sdpa-cudnn") == "skipped: sdpa-cudnn runs on CUDA devices only"
    assert all(skip(case, p) is None for p in (*FP8_PROVIDERS, "flashattn"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert skip(case, "sdpa-cudnn") is None


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_tile_variants_build_their_routes(d):
    # each A/B provider's route is the default Gluon FP8 route with its tiles replaced, and what the route
    # derives from them (two Q buffers where they fit, the registers of two or three consumers) follows
    spec = route_spec(dtype="float8_e4m3fn", out_dtype="bfloat16", headdim=d, headdim_v=d, seqlen_q=16384,
                      seqlen_k=16384)
    default = routes.gluon_forward_route(spec)
    # the configs the Gluon forward cannot take at d = 256: the row fails, naming the override
    refused = {"flashattn-fp8-k128s3": "KiB of shared memory at d = 256",
               "flashattn-fp8-m192": "block_m 128 \\(consumer"}
    for name, tiles, _ in TILE_VARIANTS:
        if d == 256 and name in refused:
            with pytest.raises(FlashAttnError, match=refused[name]):
                tiled_route(routes.gluon_forward_route, spec, tiles)
            continue
        route = tiled_route(routes.gluon_forward_route, spec, tiles)
        assert route.tiles == dataclasses.replace(default.tiles, **tiles), name
        assert route.q_buffers == routes.gluon_q_buffers(spec, route.tiles, route.head_dim)
        three = route.tiles.block_m == 192
        assert route.maxnreg == (routes.MAXNREG_THREE if three else routes.MAXNREG_TWO)
    assert flashattn_config.tile_overrides == {}  # the override ends with the build


# -- the providers' quantisation


@pytest.mark.parametrize("name", FP8_PROVIDERS)
def test_providers_quantise_as_named(name):
    recipe = RECIPES[name]
    case = _case(b=2, h=4, hk=2)
    q, k, v = _inputs(case)
    x = recipe.quantize(q, k, v)
    assert all(t.dtype == torch.float8_e4m3fn for t in x[:3])
    assert [tuple(d.shape) for d in x[3:]] == [(2, 4), (2, 2), (2, 2)]  # per head
    # flashattn-fp8-rowv keeps V in the ordinary layout, the others have its seqlen dim contiguous
    assert (x.v8.stride(1) == 1) == (name != "flashattn-fp8-rowv")
    assert torch.equal(fp8.dequantize(x.v8, x.v_descale), fp8.dequantize(*fp8.quantize(v, "head")))
    seed = 0 if recipe.rotate else None
    assert torch.equal(x.q8.float(), fp8.quantize(q, "head", rotate_seed=seed)[0].float())
    assert recipe.info()["fp8_quantize_timed"] == name.endswith("+quant")


def test_timed_quantisation_gives_the_checked_copy():
    # the oracle is built on the setup's copy: the call that quantises inside the timed region must compute
    # on exactly the same e4m3 values
    case = _case()
    q, k, v = _inputs(case)
    with flashattn_config.use_backend("torch"), torch.no_grad():
        timed = prepare(RECIPES["flashattn-fp8+rot+quant"], case, q, k, v).fwd()
        ahead = fp8_attention(Recipe(rotate=True).quantize(q, k, v), case, torch.float16, {})
    assert timed.dtype == torch.float16 and torch.equal(timed, ahead)


# -- the check: the oracle on the dequantised inputs


def _drop(which: str):
    """The public FP8 call with one descale left out (so taken as 1): a wrong output."""
    def call(x, case, out_dtype, options):
        descales = {"q_descale": x.q_descale, "k_descale": x.k_descale, "v_descale": x.v_descale}
        descales.pop(which)
        import flashattn

        return flashattn.flash_attn_func(x.q8, x.k8, x.v8, causal=case.causal, out_dtype=out_dtype,
                                         **descales)

    return call


def test_fp8_check_takes_the_kernel_and_rejects_a_dropped_descale():
    # the automatic backend: the Triton kernel interpreted under TRITON_INTERPRET=1, with its e4m3 rounding
    case = _case(n=48, d=32)
    q, k, v = _inputs(case, seed=1)
    x = Recipe().quantize(q, k, v)
    oracle = Fp8Oracle(case, *x, out_dtype=torch.float16)
    assert oracle.checked_on == ("batch 0, heads 0-1, all 48 q rows; the oracle on the dequantised e4m3 "
                                 "inputs")
    with torch.no_grad():
        good = oracle.check(fp8_attention(x, case, torch.float16, {}), None)
        assert good.fwd_error is None and good.out_err <= oracle.out_tol
        assert FP8_FLOOR < oracle.out_tol < 0.2  # e4m3's rounding of the numerators, not of order |out|
        bad = oracle.check(_drop("v_descale")(x, case, torch.float16, {}), None)
    assert bad.fwd_error is not None and bad.fwd_error.startswith("wrong result: output max|err|")
    assert "dequantised e4m3" in bad.fwd_error


@pytest.mark.parametrize("which", ["q_descale", "k_descale", "v_descale"])
def test_fp8_check_on_a_slice_of_gqa_heads_and_rows(which):
    # a budget that checks the first and last 32 rows of the first kv head's group; q's descale per kv head
    case = _case(b=2, h=4, hk=2, n=256, d=16, causal=True)
    q, k, v = _inputs(case, seed=2)
    x = Recipe().quantize(q, k, v)
    q8, qd = fp8.quantize(q.view(2, 256, 2, 32), "head")
    x = x._replace(q8=q8.view(2, 256, 4, 16), q_descale=qd)
    oracle = Fp8Oracle(case, *x, out_dtype=torch.float16, budget_bytes=64 * 1024)
    assert oracle.checked_on == ("batch 0, heads 0-1 (kv heads 0-0), q rows 0-31 & 224-255 of 256 (with all "
                                 "the keys they see); the oracle on the dequantised e4m3 inputs")
    with flashattn_config.use_backend("torch"), torch.no_grad():
        good = oracle.check(fp8_attention(x, case, torch.float16, {}), None)
        bad = oracle.check(_drop(which)(x, case, torch.float16, {}), None)
    assert good.fwd_error is None, good.fwd_error
    assert bad.fwd_error is not None and bad.fwd_error.startswith("wrong result")


def test_fp8_check_sees_the_window_and_softcap_the_call_takes():
    # fp32 out: a softcap of 2 on unit scores changes them by far more than fp32's rounding, less than e4m3's
    case = Case(1, 2, 2, 96, 96, 16, True, "float32",
                {"inputs": "normal", "window_left": 8, "window_right": 0, "softcap": 2.0})
    q, k, v = _inputs(case, seed=4, dtype=torch.float32)

    def without(key):
        return lambda x, case, out_dtype, options: fp8_attention(
            x, case, out_dtype, {k: o for k, o in options.items() if k != key})

    with flashattn_config.use_backend("torch"):
        verdicts = {}
        for name, call in (("both", fp8_attention), ("no window", without("window_size")),
                           ("no softcap", without("softcap"))):
            prep = prepare(Recipe(), case, q, k, v, call=call)
            oracle = prep.oracle(64 * 1024)
            with prep.context():
                verdicts[name] = oracle.check(prep.fwd(), None)
    assert "window (8, 0), softcap 2" in oracle.checked_on
    assert verdicts["both"].fwd_error is None, verdicts["both"].fwd_error
    assert verdicts["no window"].fwd_error.startswith("wrong result")
    assert verdicts["no softcap"].fwd_error.startswith("wrong result")


# -- accuracy measures on hand-made tensors


def test_accuracy_measures_by_hand():
    ref = torch.tensor([1.0, 2.0, -3.0, 4.0])
    out = torch.tensor([1.0, 2.0, -3.0, 6.0])
    assert accuracy.rmse(out, ref) == pytest.approx(1.0)  # sqrt(2² / 4)
    assert accuracy.rel_l1(out, ref) == pytest.approx(0.2)  # 2 / 10
    assert accuracy.max_abs(out, ref) == 2.0
    assert accuracy.rmse(torch.tensor([3.0, 0, 0, 4.0]), torch.zeros(4)) == pytest.approx(2.5)
    assert accuracy.cosine(out, ref) == pytest.approx(38 / (math.sqrt(50) * math.sqrt(30)))
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    assert accuracy.cosine(3 * x, x) == pytest.approx(1.0) and accuracy.cosine(-x, x) == pytest.approx(-1.0)
    assert accuracy.cosine(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])) == 0.0
    assert accuracy.cosine(torch.zeros(3), torch.zeros(3)) == 1.0
    assert accuracy.cosine(torch.zeros(3), torch.ones(3)) == 0.0
    assert accuracy.rel_l1(torch.zeros(3), torch.zeros(3)) == 0.0
    assert accuracy.rel_l1(torch.ones(3), torch.zeros(3)) == math.inf
    # a dtype of its own is compared in float64; the same values give no error at all
    assert accuracy.errors(ref.half(), ref.double()) == {"rmse": 0.0, "rel_l1": 0.0, "cosine": 1.0,
                                                         "max_abs_err": 0.0}
    assert math.isnan(accuracy.rmse(torch.tensor([math.nan, 0.0]), torch.zeros(2)))
    with pytest.raises(ValueError, match="out has shape"):
        accuracy.rmse(torch.zeros(2, 3), torch.zeros(3, 2))


def test_outlier_inputs_are_a_tenth_of_a_percent_ten_times_larger():
    n = 1_000_000
    plain = accuracy.gaussian(n, generator=torch.Generator().manual_seed(3))
    spiked = accuracy.gaussian(n, outliers=True, generator=torch.Generator().manual_seed(3),
                               dtype=torch.float64)
    assert spiked.dtype == torch.float64 and plain.dtype == torch.float32
    ratio = spiked / plain.double()
    big = ratio != 1
    # the rest exactly the plain draw; the outliers ten times it (x10 in float32, then widened)
    assert torch.allclose(ratio[big], torch.full_like(ratio[big], accuracy.OUTLIER_FACTOR), rtol=1e-6, atol=0)
    assert 850 < int(big.sum()) < 1150  # 1000 expected, sd 32


# -- annotations


def _row(provider, mode, case, **fields):
    row = {"suite": "fp8", "provider": provider, "mode": mode, **case.fields(), "error": None}
    row.update(fields)
    return row


def test_annotate_speedups_and_rotation_gain():
    case, other = _case(), _case(n=128)
    outl = dataclasses.replace(case, extra={"inputs": "outliers"})
    rows = [
        _row("flashattn", "fwd", case, ms=2.0),
        _row("flashattn-fp8", "fwd", case, ms=1.0),
        _row("flashattn-fp8+quant", "fwd", case, ms=2.5),
        _row("sdpa-cudnn", "fwd", case, ms=None, error="skipped: sdpa-cudnn runs on CUDA devices only"),
        _row("flashattn-fp8", "fwd", other, ms=1.0),  # no flashattn row at this shape
        _row("fp8-tensor", ACCURACY_MODE, outl, rmse=0.03),
        _row("fp8-tensor+rot", ACCURACY_MODE, outl, rmse=0.01),
        _row("fp8-head+rot", ACCURACY_MODE, outl, rmse=0.02),
        _row("fp8-tensor+rot", ACCURACY_MODE, case, rmse=0.01),  # no fp8-tensor row on normal inputs
        _row("flashattn", ACCURACY_MODE, outl, rmse=0.001),
    ]
    annotate(rows)
    assert [r.get(SPEEDUP_FIELD) for r in rows[:5]] == [1.0, 2.0, 0.8, None, None]
    assert [r.get(GAIN_FIELD) for r in rows[5:]] == [1.0, pytest.approx(3.0), pytest.approx(1.5), None,
                                                     pytest.approx(30.0)]
    assert rows[6]["meets_target"] is True and "target >= 2" in rows[6]["target"]
    assert all("meets_target" not in r for i, r in enumerate(rows) if i != 6)
    rows[6]["rmse"] = 0.02
    annotate(rows)
    assert rows[6]["meets_target"] is False and rows[6][GAIN_FIELD] == pytest.approx(1.5)


# -- end to end


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fp8_suite_smoke_on_cpu(tmp_path, monkeypatch):
    # the harness end to end; the torch backend stands in for the kernels
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _parse("--suite", "fp8", "--device", "cpu", "--quick", "--quiet", "--no-plots", "--seqlens", "64",
                  "--headdims", "32", "--hidden", "64", "--tokens", "128", "--dtype", "fp16", "--out",
                  str(tmp_path))  # fmt: skip
    assert cli.run(args) == 0
    rows = json.loads((tmp_path / "fp8.json").read_text())["rows"]
    timed = {(r["provider"], r["causal"]): r for r in rows if r["mode"] == "fwd"}
    assert len(timed) == 8 * 2
    for (name, causal), r in timed.items():
        assert (r["batch"], r["nheads"], r["seqlen_q"], r["headdim"], r["inputs"]) == (2, 2, 64, 32, "normal")
        if name in ("sdpa-cudnn", "flashattn-fp8-gluon", "flashattn-fp8-triton"):
            assert r["error"] == f"skipped: {name} runs on CUDA devices only" and r["ms"] is None
            continue
        assert r["error"] is None, (name, r["error"])
        assert r["ms"] > 0 and r[SPEEDUP_FIELD] == pytest.approx(timed[("flashattn", causal)]["ms"] / r["ms"])
        flops = attention_flops(2, 2, 64, 64, 32, causal)  # 4·b·h·pairs·d, half the square when causal
        assert r["tflops"] == pytest.approx(flops / (r["ms"] * 1e-3) / 1e12)
        if name in FP8_PROVIDERS:
            assert r["checked_on"].endswith("the oracle on the dequantised e4m3 inputs")
            assert r["fp8_descale"] == "head" and r["route_fwd"] == "torch"
            assert r["fp8_v_layout"] == ("row" if name == "flashattn-fp8-rowv" else "seq-contiguous")
        else:
            assert r["checked_on"].endswith("grads from dout zero elsewhere") and "fp8_descale" not in r
    acc = {(r["provider"], r["inputs"], r["causal"]): r for r in rows if r["mode"] == ACCURACY_MODE}
    assert len(acc) == 5 * 2 * 2 and len(rows) == len(timed) + len(acc)
    for (name, inputs, causal), r in acc.items():
        assert r["error"] is None, (name, r["error"])
        assert (r["batch"], r["nheads"], r["seqlen_q"], r["headdim"]) == (1, 2, 64, 32)
        assert "ms" not in r and "tflops" not in r
        assert 0 < r["rmse"] and 0 < r["rel_l1"] < 0.2 and 0.99 < r["cosine"] <= 1 + 1e-12
        bf16 = acc[("flashattn", inputs, causal)]
        if name != "flashattn":
            # e4m3 keeps 3 mantissa bits against fp16's 10: far coarser than the 16-bit kernel
            assert r["rmse"] > 10 * bf16["rmse"] and r["fp8_rotated"] == name.endswith("+rot")
        assert r[GAIN_FIELD] == pytest.approx(acc[("fp8-tensor", inputs, causal)]["rmse"] / r["rmse"])
        assert ("meets_target" in r) == (name == "fp8-tensor+rot" and inputs == "outliers")
    md = (tmp_path / "fp8.md").read_text()
    # the FP8 providers' oracle is named beside the dense one
    assert "the FP8 providers: flashattn.reference.attention_ref_fp8(upcast=True) on their dequantised" in md
    for title in ("## fwd: TFLOP/s", "## fwd: speedup over flashattn bf16", "## accuracy: RMSE",
                  "## accuracy: relative L1 error", "## accuracy: cosine similarity",
                  "## accuracy: fp8-tensor's RMSE / this one's"):
        assert title in md, title
    assert "| causal | inputs | flashattn | fp8-tensor | fp8-head | fp8-tensor+rot | fp8-head+rot |" in md
    assert "flashattn-fp8 / flashattn:" in md
    assert "sdpa-cudnn: skipped: sdpa-cudnn runs on CUDA devices only" in md


def _run(provider_names, tmp_path, case, suite=SUITE) -> list[dict]:
    cfg = RunConfig(suite=dataclasses.replace(suite, extra_rows=None), cases=[case],
                    providers=list(provider_names), modes=("fwd",), device=torch.device("cpu"),
                    timer=TimerConfig.quick(), out_json=tmp_path / "fp8.json", quiet=True)
    return Runner(cfg).run()["rows"]


def test_runner_checks_the_kernel_and_does_not_time_a_dropped_descale(tmp_path):
    # flashattn-fp8 on the automatic backend (the interpreted kernel under TRITON_INTERPRET=1) passes its
    # check; a provider whose call drops v's descale is reported wrong and not timed
    bad = Provider("fp8-no-v-descale",
                   lambda case, q, k, v: prepare(Recipe(), case, q, k, v, call=_drop("v_descale")))
    providers.register(bad)
    try:
        rows = _run(["flashattn-fp8", bad.name], tmp_path, _case(n=48, d=32, causal=False))
    finally:
        providers.unregister(bad.name)
    good, wrong = rows
    assert good["error"] is None and good["ms"] > 0 and good["max_abs_err"] > 0
    assert good["route_fwd"] == ("TritonForward" if flashattn_config.INTERPRET else "torch")
    assert wrong["error"].startswith("wrong result: output max|err|") and wrong["ms"] is None
    assert wrong["checked_on"].endswith("the oracle on the dequantised e4m3 inputs")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_route_variants_build_their_routes(d):
    # the qk_ahead providers: the default Gluon FP8 route on their tiles (two consumers' registers), with
    # qk_ahead on and nothing else of it changed
    spec = route_spec(dtype="float8_e4m3fn", out_dtype="bfloat16", headdim=d, headdim_v=d, seqlen_q=16384,
                      seqlen_k=16384)
    for name, tiles, fields, _ in ROUTE_VARIANTS:
        plain = tiled_route(routes.gluon_forward_route, spec, tiles)
        route = tiled_route(routes.gluon_forward_route, spec, tiles, **fields)
        assert route == dataclasses.replace(plain, qk_ahead=True), name
        assert route.tiles.block_m == 128 and route.maxnreg == routes.MAXNREG_TWO and not route.half_diag
    assert flashattn_config.tile_overrides == {}
