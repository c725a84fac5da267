"""The e2e training suite: a CPU smoke run of the whole pipeline (tiny model, few steps), the convergence
verdict on made-up curves, and on the GPU a short real run plus the model with each attention against a
float64 oracle."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from utils import assert_close_to_ref

from flashattn import config as flashattn_config
from flashattn.bench import results
from flashattn.bench.gpt import GPT, GPT2_SMALL, GPTConfig, attention_impl
from flashattn.bench.suites import e2e

HAS_CUDA = torch.cuda.is_available()

TINY = e2e.E2EConfig(
    model=GPTConfig(vocab_size=256, n_layer=1, n_head=2, n_embd=32, max_seqlen=64),
    seqlens=(32,),
    tokens_per_step=64,
    warmup_steps=1,
    timed_steps=1,
    providers=("flashattn", "naive"),
    converge_providers=("flashattn", "sdpa-math"),
    converge_steps=6,
    converge_seqlen=32,
    converge_tokens=64,
    corpus_bytes=256 << 10,
    autocast=None,
    reference="sdpa-math",
    yardstick="",
    tail=3,
)


@pytest.fixture(autouse=True)
def _torch_backend_off_gpu(request, monkeypatch):
    # CI runs with TRITON_INTERPRET=1, which would interpret the kernels at every training step
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(flashattn_config, "backend", "torch")


def test_cpu_smoke_run_writes_rows_and_plots(tmp_path):
    rows = e2e.run_e2e(TINY, torch.device("cpu"), quiet=True)
    train = [r for r in rows if r["mode"] == "train"]
    conv = {r["provider"]: r for r in rows if r["mode"] == "converge"}
    assert [r["provider"] for r in train] == ["flashattn", "naive"]
    for r in rows:
        assert r["error"] is None, r
    for r in train:
        assert r["tokens_per_s"] > 0 and r["ms"] > 0 and r["n_params"] > 0
    ours = conv["flashattn"]
    assert len(ours["loss_curve"]) == 6 and ours["loss_curve"][-1] < ours["loss_curve"][0]
    # fp32, same init and data: the curves agree to rounding, far inside the allowance
    assert ours["within_noise"] and ours["max_step_gap"] < 1e-4

    doc = {"meta": e2e._meta(TINY, torch.device("cpu"), quick=True), "rows": rows}
    written = e2e._report(doc, TINY, tmp_path, plots=True)
    back = results.load(tmp_path / "e2e.json")
    assert len(back["rows"]) == len(rows) and back["meta"]["e2e"]["converge_steps"] == 6
    md = (tmp_path / "e2e.md").read_text()
    assert "## Convergence" in md and "within noise" in md and "FlashAttention convention" not in md
    pngs = {p.name for p in written if p.suffix == ".png"}
    if pytest.importorskip("matplotlib"):
        assert "e2e-loss.png" in pngs and "e2e-train-tokens_per_s.png" in pngs


def test_cli_refuses_on_cpu_without_device(capsys):
    if HAS_CUDA:
        pytest.skip("the refusal is for machines without a GPU")
    from flashattn.cli import main

    assert main(["bench", "--suite", "e2e"]) == 2
    assert "sized for a GPU" in capsys.readouterr().err


def test_cli_runs_the_suite(tmp_path, monkeypatch):
    # `flashattn bench --suite e2e --device cpu` reaches the suite's own runner with the CLI's overrides
    from flashattn.cli import main

    seen = {}

    def fake_run_e2e(cfg, device, **kwargs):
        seen["cfg"], seen["device"] = cfg, device
        return []

    monkeypatch.setattr(e2e, "run_e2e", fake_run_e2e)
    argv = ["bench", "--suite", "e2e", "--device", "cpu", "--quick", "--seqlens", "64", "--tokens", "128"]
    assert main([*argv, "--providers", "flashattn,naive", "--out", str(tmp_path), "--no-plots"]) == 0
    assert seen["device"].type == "cpu"
    assert seen["cfg"].seqlens == (64,) and seen["cfg"].tokens_per_step == 128
    assert seen["cfg"].providers == ("flashattn", "naive")
    assert json.loads((tmp_path / "e2e.json").read_text())["meta"]["suite"] == "e2e"


def test_corpus_is_the_standard_library():
    corpus = e2e.load_corpus(1 << 16)
    assert corpus.numel() == 1 << 16 and corpus.dtype == torch.int64
    text = bytes(corpus.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def _conv_rows(curves):
    return [{"mode": "converge", "provider": name, "loss_curve": curve} for name, curve in curves.items()]


def test_convergence_verdict():
    cfg = dataclasses.replace(TINY, converge_steps=100, tail=20, reference="ref", yardstick="yard")
    base = [3.0 - 0.01 * i + 0.05 * (-1) ** i for i in range(100)]  # trend plus step-to-step scatter
    rows = _conv_rows(
        {
            "ref": base,
            "yard": [x + 0.002 for x in base],
            "close": [x + 0.003 for x in base],
            "off": [x + 0.2 for x in base],
        }
    )
    e2e.annotate_convergence(rows, cfg)
    by = {r["provider"]: r for r in rows}
    assert by["close"]["within_noise"] and not by["off"]["within_noise"]
    assert by["close"]["yardstick_gap"] == pytest.approx(0.002)
    assert "final_gap" not in by["ref"] and by["ref"]["final_loss"] == pytest.approx(sum(base[-20:]) / 20)
    lines = e2e.convergence_lines(rows)
    assert any("off" in x and "NOT within noise" in x for x in lines)


def test_speedup_lines():
    rows = [
        {"mode": "train", "provider": p, "seqlen_q": 1024, "tokens_per_s": t, "error": None}
        for p, t in (("flashattn", 300.0), ("naive", 100.0), ("sdpa-cudnn", 250.0))
    ]
    assert e2e.speedups(rows) == [
        "flashattn vs naive at N=1024: 3.00x tokens/s",
        "flashattn vs sdpa-cudnn at N=1024: 1.20x tokens/s",
    ]


def test_gpt2_small_has_124m_parameters():
    with torch.device("meta"):
        model = GPT(GPT2_SMALL, attention_impl("naive"))
    assert round(model.num_params() / 1e6) == 124


# -- GPU -----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["flashattn", "sdpa-cudnn", "flex", "naive"])
def test_gpu_model_grads_match_oracle(name):
    # the same weights and batch through each attention in bf16 autocast, against the model in float64
    # (sdpa-math); sdpa-flash in bf16 is the low-precision yardstick
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_embd=256, max_seqlen=1024)
    torch.manual_seed(0)
    idx = torch.randint(0, 512, (2, 1001), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]

    def run(impl_name, dtype):
        impl = attention_impl(impl_name)
        torch.manual_seed(1)
        model = GPT(cfg, impl).cuda()
        if dtype == torch.float64:
            model = model.double()
        impl.prepare(x.shape[1], x.device)
        with impl.context(), torch.autocast("cuda", torch.bfloat16, enabled=dtype != torch.float64):
            loss = model(x, y)
        loss.backward()
        # gradients, not the scalar loss: one number's error is too noisy a yardstick for the rule
        return [model.blocks[0].attn.qkv.weight.grad, model.blocks[-1].fc.weight.grad, model.wte.weight.grad]

    got, pt, ref = run(name, torch.float32), run("sdpa-flash", torch.float32), run("sdpa-math", torch.float64)
    for label, a, p, r in zip(("dWqkv[0]", "dWfc[-1]", "dwte"), got, pt, ref, strict=True):
        assert_close_to_ref(a, r, p, factor=3.0, name=f"{name} {label}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_short_e2e_run(tmp_path):
    cfg = dataclasses.replace(
        e2e.E2EConfig.preset(torch.device("cuda"), quick=True),
        seqlens=(1024,),
        warmup_steps=1,
        timed_steps=2,
        providers=("flashattn", "sdpa-cudnn"),
        converge_steps=40,
        tail=10,
    )
    rows = e2e.run_e2e(cfg, torch.device("cuda"), quiet=True)
    for r in rows:
        assert r["error"] is None, r
    ours = next(r for r in rows if r["mode"] == "converge" and r["provider"] == "flashattn")
    assert ours["within_noise"], ours
    doc = {"meta": e2e._meta(cfg, torch.device("cuda"), quick=True), "rows": rows}
    e2e._report(doc, cfg, tmp_path, plots=False)
    assert (tmp_path / "e2e.json").exists()
