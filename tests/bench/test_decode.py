"""The `decode` bench suite on the CPU (torch backend, tiny shapes): the FP8-cache providers' setup, the
oracle they are checked against (the dequantised cache's), the bytes and K/V tokens per second their rows
report, the speedup over the 16-bit cache, the call the FA4 provider makes, and a smoke run of the suite."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn.bench import cli
from flashattn.bench import providers as provider_registry
from flashattn.bench.case import Case
from flashattn.bench.check import Oracle
from flashattn.bench.suites import decode as suite
from flashattn.fp8 import FP8

SMALL = Case(2, 4, 2, 1, 40, 16, False, "float32", {"kv_len": 40, "page_size": 16, "kv_bytes": 0})


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 40, 2, 16, generator=g), \
        torch.randn(2, 40, 2, 16, generator=g)


def test_fp8_providers_are_ours():
    for name in (suite.OURS_FP8, suite.OURS_FP8_GRAPH):
        assert provider_registry.all_providers()[name].name == name
        assert name in suite.SUITE.providers
        assert suite._skip(SMALL, name) is None  # paged cases run
    assert suite._skip(SMALL, "sdpa-flash")


@pytest.mark.parametrize("page", [None, 16])
def test_fa4_decode_setup_passes_lengths_and_page_table(monkeypatch, page):
    # FA4 is not on the CPU: a stand-in module records the call the provider makes
    calls = []

    def varlen(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return q, None

    fake = types.ModuleType("flash_attn.cute.interface")
    fake.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fake)
    assert suite._skip(SMALL, suite.FA4) is None and suite._skip(SMALL, suite.FA4_GRAPH) is None
    case = Case(2, 4, 2, 1, 40, 16, False, "float32", {"kv_len": 40, "page_size": page, "kv_bytes": 0})
    q, k, v = _inputs()
    out = suite._setup_fa4(case, q, k, v).fwd()
    (qc, kc, vc, kw), = calls
    assert out is qc and qc.shape == (2, 1, 4, 16)
    assert kw["seqused_k"].tolist() == [40, 40] and kw["max_seqlen_k"] == 40
    if page is None:
        assert kw["page_table"] is None and torch.equal(kc, k) and torch.equal(vc, v)
    else:
        table = kw["page_table"]
        assert table.shape == (2, 3) and table.dtype == torch.int32 and kc.shape == (6, 16, 2, 16)
        # the pages the table names hold the keys and values in order
        assert torch.equal(kc[table[1].long()].reshape(48, 2, 16)[:40], k[1])
        assert torch.equal(vc[table[1].long()].reshape(48, 2, 16)[:40], v[1])


@pytest.mark.parametrize("page", [None, 16])
def test_fp8cache_setup(monkeypatch, page):
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    case = Case(2, 4, 2, 1, 40, 16, False, "float32", {"kv_len": 40, "page_size": page, "kv_bytes": 0})
    q, k, v = _inputs()
    prep = suite._setup_fp8cache(case, q, k, v)
    assert prep.info == {"kv_bytes": 2 * 2 * 40 * 2 * 16, "cache_dtype": "float8_e4m3fn"}
    out = prep.fwd()
    # its own oracle, on the dequantised cache: passed at fp32's precision
    own = prep.oracle(2**20)
    assert own.check(out, None).fwd_error is None and "dequantised e4m3 cache" in own.checked_on
    # the case's oracle counts e4m3's rounding as an error: why the provider brings its own
    case_oracle = Oracle(case, q, k, v, torch.zeros_like(q), grads=False)
    assert case_oracle.check(out, None).fwd_error is not None
    # the same call as the 16-bit provider's apart from the cache: close to it, by e4m3's rounding
    ref = suite._setup_kvcache(case, q, k, v).fwd()
    assert 1e-3 < (out - ref).abs().max() < 0.2


def test_annotate_tokens_and_speedup():
    def row(provider, ms, kv_bytes, page=None, error=None):
        return {"provider": provider, "mode": "fwd", "batch": 16, "nheads": 32, "nheads_k": 8, "headdim": 128,
                "dtype": "bfloat16", "kv_len": 65536, "page_size": page, "ms": ms, "kv_bytes": kv_bytes,
                "error": error}

    full = 2 * 16 * 65536 * 8 * 128 * 2
    rows = [row(suite.OURS_GRAPH, 2.0, full), row(suite.OURS_FP8_GRAPH, 1.0, full // 2),
            row(suite.OURS, 3.0, full, page=64), row(suite.OURS_FP8, 2.0, full // 2, page=64),
            row(suite.OURS_FP8, 1.0, full // 2, page=256), row(suite.OURS_FP8_GRAPH, None, full // 2, page=64,
                                                                error="skipped")]
    suite.annotate(rows)
    assert rows[0]["kv_tokens_per_s"] == pytest.approx(16 * 65536 / 2e-3)
    assert rows[1]["tbps"] == pytest.approx(rows[0]["tbps"])  # half the bytes in half the time
    assert rows[1][suite.SPEEDUP_FIELD] == pytest.approx(2.0)
    assert rows[3][suite.SPEEDUP_FIELD] == pytest.approx(1.5)  # eager against eager, same page size
    assert rows[4][suite.SPEEDUP_FIELD] is None  # no 16-bit row of that shape
    assert rows[5][suite.SPEEDUP_FIELD] is None and rows[5]["kv_tokens_per_s"] is None
    assert suite.SPEEDUP_FIELD not in rows[0]


def test_decode_suite_smoke_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([
        "--suite", "decode", "--device", "cpu", "--quiet", "--no-plots", "--quick", "--seqlens", "40",
        "--batch", "2", "--nheads", "4", "--nheads-k", "2", "--headdims", "16", "--dtype", "fp32",
        "--providers", f"{suite.OURS},{suite.OURS_FP8}", "--out", str(tmp_path),
    ])  # fmt: skip
    assert cli.run(args) == 0
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    assert len(rows) == 2 * 3 * 2  # batch 1 and 2, contiguous and pages of 64 and 256, two providers
    for r in rows:
        assert r["error"] is None, (r["provider"], r["error"])
        assert r["kv_tokens_per_s"] > 0 and r["max_abs_err"] < 1e-5
        if r["provider"] == suite.OURS_FP8:
            assert r["kv_bytes"] == 2 * r["batch"] * 40 * 2 * 16 and r["cache_dtype"] == str(FP8)[6:]
            assert r[suite.SPEEDUP_FIELD] > 0
    text = (tmp_path / "decode.md").read_text()
    assert "K/V tokens per second" in text and "fp8 cache speedup" in text
