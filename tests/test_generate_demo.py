"""flashattn.generate_demo on the CPU: paged generation (a DecodePlan for the decode steps) agrees with SDPA's
teacher-forced argmax at every step (the demo's own check, its exit code)."""

from flashattn import config as flashattn_config
from flashattn.generate_demo import main


def test_cpu_run_agrees_with_sdpa(monkeypatch, capsys):
    # the torch backend: under TRITON_INTERPRET=1 every token would interpret the kernels
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    rc = main(["--device", "cpu", "--batch", "3", "--new-tokens", "5", "--prompt-len", "40",
               "--page-size", "16", "--layers", "2", "--d-model", "64", "--heads", "4", "--kv-heads", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ours (DecodePlan, paged)" in out and "0 real disagreements" in out
