"""flashattn.distributed on GPUs through NCCL: the Triton kernels inside the ring, Ulysses and varlen, and
an NCCL transfer overlapping compute. One process per GPU; the world of one runs anywhere with a GPU."""

from __future__ import annotations

import functools

import pytest
import torch
from cp_cases import GPU_CASES
from cp_harness import run_world

pytestmark = pytest.mark.gpu


@functools.cache
def _outcomes(world: int) -> dict:
    return run_world(world, GPU_CASES, backend="nccl")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_case(world, name):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    error = _outcomes(world)[name]
    if error is not None:
        pytest.fail(error, pytrace=False)
