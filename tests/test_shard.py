"""--shard I/N (tests/conftest.py): the device runs a suite longer than one call as N calls; the shares
must be disjoint, cover every selected test, and be cut after -m / -k."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _collected(*args) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "test_merge.py"), *args], capture_output=True, text=True, cwd=TESTS)
    assert run.returncode in (0, 5), run.stdout + run.stderr  # 5: nothing collected
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shares_partition_the_selection():
    whole = _collected("-k", "not gpu")
    shares = [_collected("-k", "not gpu", "--shard", f"{i}/3") for i in (1, 2, 3)]
    assert len(whole) >= 6 and all(shares)
    assert sorted(sum(shares, [])) == sorted(whole)
    assert shares[0] == whole[0::3]


@pytest.mark.parametrize("value", ["4/3", "a/b"])
def test_a_bad_share_says_what_it_expects(value):
    run = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                          str(TESTS / "test_merge.py"), "--shard", value], capture_output=True, text=True,
                         cwd=TESTS)
    assert run.returncode != 0 and "expected I/N with 1 <= I <= N" in run.stderr + run.stdout
