"""The generate suite: a CPU smoke run of the whole pipeline (a tiny 8-layer GQA Llama, a few tokens, both
cache setups, ours and sdpa), its report, and the speedup lines."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn.bench import results
from flashattn.bench.suites import generate

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    # CI runs with TRITON_INTERPRET=1, which would interpret the kernels at every token
    monkeypatch.setattr(flashattn_config, "backend", "torch")


def test_cpu_smoke_run_writes_rows(tmp_path):
    device = torch.device("cpu")
    cfg = dataclasses.replace(generate.GenerateConfig.preset(device, quick=True), batches=(2,), new_tokens=3)
    rows = generate.run_generate(cfg, device, quiet=True)
    assert [(r["provider"], r["mode"]) for r in rows] == [
        (p, m) for p in ("flashattn", "sdpa") for m in ("eager", "static-graph")]
    for r in rows:
        assert r["error"] is None, r
        # ms and prefill_ms are separate timings (medians of their own runs): on a loaded CPU the whole
        # generate can time below its prefill, and then the suite leaves decode_tokens_per_s unset
        assert r["tokens_per_s"] > 0 and r["ms"] > 0 and r["prefill_ms"] > 0
        assert r["decode_tokens_per_s"] is None or r["decode_tokens_per_s"] > 0
        assert (r["batch"], r["seqlen_q"], r["new_tokens"], r["nheads"], r["nheads_k"]) == (2, 16, 3, 4, 2)
    doc = {"meta": generate._meta(cfg, device, quick=True), "rows": rows}
    generate.report(doc, tmp_path, plots=False)
    back = results.load(tmp_path / "generate.json")
    assert len(back["rows"]) == 4 and back["meta"]["generate"]["layers"] == 8
    md = (tmp_path / "generate.md").read_text()
    assert "## Speedups" in md and "eager b=2 prompt=16: flashattn / sdpa" in md


def test_the_model_is_a_gqa_llama_of_eight_layers():
    cfg = generate.GenerateConfig()
    assert cfg.layers >= 8 and cfg.heads % cfg.kv_heads == 0 and cfg.heads > cfg.kv_heads
    assert cfg.hidden // cfg.heads == 128 and set(cfg.batches) == {1, 16} and set(cfg.prompts) == {1024, 8192}
    assert set(cfg.modes) == {"eager", "static-graph"} and cfg.compile_graphs
