"""The `cp` bench suite on the CPU: its prediction model on a hand-computed schedule, and the predicted mode
end to end through the CLI (the measured mode runs under gloo at world size 2 in test_cp.py, case
bench-cp-measured)."""

from __future__ import annotations

import argparse
import json

import pytest

from flashattn import config
from flashattn.bench import cli
from flashattn.bench.suites import cp


def test_ring_model_by_hand():
    # W = 3, both relays one round long: round 0 computes step 0, round 1 steps 1 and 2 (two blocks move)
    cfg = cp.CPConfig(link_gbps=1.0, latency_us=0.0)  # 1 GB/s: 1e6 bytes take 1 ms
    c_fwd = [[1.0, 2.0, 3.0]] * 3
    c_bwd = [[2.0, 4.0, 6.0]] * 3
    t_f, t_b, comp_f, comp_b, comm_f, comm_b = cp.ring_model(c_fwd, c_bwd, 1, 1, 3, 4_000_000, 8_000_000, cfg)
    # forward: max(C(0) = 1, two K/V blocks = 8) + C(1) = 2 + 3
    assert (t_f, comp_f, comm_f) == (13.0, 6.0, 8.0)
    # backward: max(C'(0) = 2, 8) + max(C'(1) = 10, nothing in flight) + two dK/dV blocks returning = 16
    assert (t_b, comp_b, comm_b) == (34.0, 12.0, 24.0)


def test_ring_model_slowest_rank_sets_each_round():
    cfg = cp.CPConfig(link_gbps=1.0, latency_us=0.0)
    c = [[1.0, 5.0], [3.0, 1.0]]  # W = 2: one relay, one round; rank 1 is slower at step 0, rank 0 at step 1
    t_f, *_ = cp.ring_model(c, c, 1, 0, 2, 1_000_000, 0, cfg)
    assert t_f == 3.0 + 5.0


def test_predicted_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "backend", "torch")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--suite", "cp", "--device", "cpu", "--quick", "--quiet", "--out", str(tmp_path)]
    args = parser.parse_args(argv)
    assert cli.run(args) == 0
    rows = json.loads((tmp_path / "cp.json").read_text())["rows"]
    assert {(r["method"], r["mode"], r["scaling"]) for r in rows} == {
        (m, mode, s) for m in ("ring", "ulysses") for mode in ("fwd", "fwd+bwd") for s in ("weak", "strong")}
    for r in rows:
        assert r["kind"] == "predicted" and r["world"] == 2 and r["error"] is None
        assert r["ms"] > 0 and r["tflops"] > 0 and r["single_ms"] > 0 and r["efficiency"] > 0
        assert 0.0 <= r["hidden"] <= 1.0
        assert r["comm_ms"] > 0 and r["compute_ms"] > 0
    md = (tmp_path / "cp.md").read_text()
    assert "Weak scaling" in md and "Strong scaling" in md and "ASSUMED" in md


@pytest.mark.gpu
def test_predicted_on_gpu(tmp_path):
    cfg = cp.CPConfig(worlds=(2, 4), weak_local=(4096,), strong_global=(16384,), causal=(True,), iters=3)
    rows = cp.predict(cfg, cp.torch.device("cuda"), quiet=True)
    assert rows and all(r["ms"] > 0 and 0.0 <= r["hidden"] <= 1.0 for r in rows)
