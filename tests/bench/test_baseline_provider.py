"""`flashattn-baseline`: a vendored copy of the tree (scripts/vendor_tree.sh) timed through its own public
call, beside this tree's, in one process."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashattn import config as flashattn_config
from flashattn.bench import providers, suites
from flashattn.bench.suites.workloads import FULL_OPTIONS, build_cases, skip

ROOT = Path(__file__).resolve().parents[2]
NAME = "flashattn_base"


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    """This checkout's HEAD vendored as flashattn_base, importable; removed from sys.modules afterwards."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (scripts/vendor_tree.sh takes a revision)")
    out = tmp_path_factory.mktemp("vendor")
    run = subprocess.run(["bash", str(ROOT / "scripts/vendor_tree.sh"), "HEAD", NAME], cwd=out,
                         env={**os.environ, "GIT_DIR": str(ROOT / ".git")}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    sys.path.insert(0, str(out / ".baseline/src"))
    try:
        yield importlib.import_module(NAME)
    finally:
        sys.path.remove(str(out / ".baseline/src"))
        for name in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
            del sys.modules[name]


def _cases():
    """The workloads suite's cases at smoke sizes, by name."""
    grid = suites.get("workloads").grid(False).override(seqlens=(64,), tokens=256)
    return {c.extra["workload"]: c for c in build_cases(grid)}


@pytest.mark.parametrize("workload", ["sink-window-1", "docs-longtail", "softcap-d128"])
def test_the_vendored_copy_runs_the_case_as_this_tree_does(vendored, monkeypatch, workload):
    # the torch backend in both builds: this is about the provider, not the kernels
    monkeypatch.setattr(flashattn_config, "backend", "torch")
    monkeypatch.setattr(vendored.config, "backend", "torch")
    case = _cases()[workload]
    assert "flashattn-baseline" in FULL_OPTIONS and skip(case, "flashattn-baseline") is None
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(case.batch, case.seqlen_q, case.nheads, case.headdim, generator=gen)
    k = torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim, generator=gen)
    v = torch.randn(case.batch, case.seqlen_k, case.nheads_k, case.headdim_v, generator=gen)
    calls = []
    for fn in ("flash_attn_func", "flash_attn_varlen_func"):  # the copy's public calls, counted
        real = getattr(vendored, fn)
        monkeypatch.setattr(vendored, fn,
                            lambda *a, real=real, fn=fn, **kw: calls.append(fn) or real(*a, **kw))
    ours, base = (providers.get(name).setup(case, q, k, v) for name in ("flashattn", "flashattn-baseline"))
    assert ours.info == {"route_fwd": "torch", "route_bwd": "torch"}
    head = subprocess.run(["git", "--git-dir", str(ROOT / ".git"), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert base.info == {**ours.info, "revision": head}
    results = []
    for prepared in (ours, base):
        with prepared.context():
            out = prepared.fwd()
            grads = torch.autograd.grad(out, prepared.leaves, torch.ones_like(out))
        results.append((out, *grads))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # the same revision on the same backend: the same bits
    # the copy's public call ran (once, in the timed closure), not this tree's
    assert calls == ["flash_attn_varlen_func" if case.lengths else "flash_attn_func"]


def test_without_the_copy_the_provider_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, NAME, None)  # as if .baseline/src were not on the path
    case = next(iter(_cases().values()))
    x = torch.zeros(case.batch, case.seqlen_q, case.nheads, case.headdim)
    with pytest.raises(ModuleNotFoundError, match=NAME):
        providers.get("flashattn-baseline").setup(case, x, x, x)
