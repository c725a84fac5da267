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


# a test per kernel family, the dense one (most of the compiles) in two interleaved parts, so that xdist's
# workers share the compiles
@pytest.mark.slow
@pytest.mark.parametrize("family, part", [("dense", "0/2"), ("dense", "1/2"), ("decode", "0/1"),
                                          ("sparse", "0/1")])
def test_every_kernel_compiles_for_sm90(tmp_path, family, part):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/sm90_compile_check.py"), family, "--quick",
                           "--part", part],
                          env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0 and "\n0 failed" in out, out[-4000:] + proc.stderr[-4000:]
    cases = int(re.search(r"^(\d+) cases$", out, re.M).group(1))
    assert cases > 0 and out.count("\nok ") == cases  # every case of the family's (part of its) quick set
