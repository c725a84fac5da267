"""Every kernel variant the public API reaches compiles for the H200 (sm_90a) within its shared memory.

The interpreter tests never compile the kernels; this runs Triton's real GPU pipeline (down to ptxas) on the
CPU through scripts/sm90_compile_check.py, in a subprocess because it swaps Triton's driver. It caught a
block-sparse forward config 1 KiB over the 227 KiB limit that every interpreter test had passed.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory):
    """One Triton cache for this run's compiles, shared by xdist's workers (their base temps have a parent of
    this run's own): the families and parts compile many of the same kernels (the dense family's two parts
    took about a fifth less time on one cache than on two), Triton's cache takes concurrent writers, and
    the shared-memory check reads a cached kernel's metadata as a fresh one's."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sm90-triton-cache"
    path.mkdir(exist_ok=True)
    return path


# a test per kernel family, the dense one (most of the compiles) in two interleaved parts, so that xdist's
# workers share the compiles
@pytest.mark.slow
@pytest.mark.parametrize("family, part", [("dense", "0/2"), ("dense", "1/2"), ("decode", "0/1"),
                                          ("sparse", "0/1")])
def test_every_kernel_compiles_for_sm90(triton_cache, family, part):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), TRITON_CACHE_DIR=str(triton_cache))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/sm90_compile_check.py"), family, "--quick",
                           "--part", part],
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0 and "\n0 failed" in out, out[-4000:] + proc.stderr[-4000:]
    cases = int(re.search(r"^(\d+) cases$", out, re.M).group(1))
    assert cases > 0 and out.count("\nok ") == cases  # every case of the family's (part of its) quick set


@pytest.mark.slow
def test_sass_report_reads_the_backward_key_step_loop(triton_cache):
    """scripts/sass_report.py on the Gluon backward at d = 64, causal: its consumers' key-step loops (the
    ones with the GEMMs), each with the masked path's branch over the unmasked one, and no spill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), TRITON_CACHE_DIR=str(triton_cache))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/sass_report.py"), "--d", "64", "--n", "300",
                           "--causal"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"^\d+ instructions; spill: 0 STL, 0 LDL$", out, re.M), out
    steps = re.findall(r"^loop \S+: instructions \d+\.\.\d+, (\d+) \(HGMMA (\d+),", out, re.M)
    with_gemms = [int(n) for n, hgmma in steps if int(hgmma) > 0]
    assert len(with_gemms) >= 2, out  # a loop per consumer warpgroup at least
    assert "skips" in out


def test_sass_report_finds_loops_and_arms():
    """The parser on a hand-written listing: a loop with an if/else, a wait's retry spin (left out) and an
    out-of-line block after EXIT that branches back into the loop (left out)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from sass_listing import report
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    ins = lambda i, text: f"        /*{i:04x}*/                   {text} ;"  # noqa: E731
    listing = "\n".join([
        ins(0, "MOV R1, c[0x0][0x28]"),
        ".L_x_1:",
        ins(16, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"),
        ".L_x_5:",
        ins(32, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2"),
        ins(48, "@!P0 BRA `(.L_x_5)"),
        ins(64, "@P1 BRA `(.L_x_2)"),
        *(ins(80 + 16 * k, "FSEL R3, R3, -INF, P2") for k in range(8)),
        ins(208, "BRA `(.L_x_3)"),
        ".L_x_2:",
        ins(224, "MUFU.EX2 R3, R3"),
        ".L_x_3:",
        ins(240, "@P3 BRA `(.L_x_1)"),
        ins(256, "EXIT"),
        ".L_x_9:",
        ins(272, "BRA `(.L_x_1)"),
    ])
    out = report(listing)
    assert out.splitlines()[0] == "18 instructions; spill: 0 STL, 0 LDL"
    loop_lines = [line for line in out.splitlines() if line.startswith("loop")]
    assert loop_lines == ["loop .L_x_1: instructions 1..15, 15 (HGMMA 1, MUFU 1, STL 0, LDL 0)"]
    assert "  branch at 4 skips 9 (to .L_x_2)" in out.splitlines()
