"""flashattn.distributed on the CPU with gloo, at world sizes 2, 3 and 4.

Each world size is spawned once (cp_harness.py) and runs every case of cp_cases.py inside its workers; each
case is reported here as its own test, so a failure names the case (and the rank, with its traceback).
"""

from __future__ import annotations

import functools

import pytest
from cp_cases import WORLDS, names_for
from cp_harness import run_world


@functools.cache
def _outcomes(world: int) -> dict:
    return run_world(world, names_for(world))


@pytest.mark.parametrize(
    ("world", "name"), [pytest.param(w, n, id=n) for w in WORLDS for n in names_for(w)]
)
def test_case(world, name):
    error = _outcomes(world)[name]
    if error is not None:
        pytest.fail(error, pytrace=False)
