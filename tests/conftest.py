"""Shared pytest configuration: markers, backend/dtype parametrisation, seeding.

Backends under test:
  * ``torch``  -- always (pure PyTorch, runs on whatever device the tensors live on).
  * ``triton`` -- on CUDA, or on CPU when the process was started with ``TRITON_INTERPRET=1``
    (the Triton interpreter; slow, and it computes bf16 wrong, so fp16 only there, see backend_dtypes).

A test that takes the ``backend`` fixture gets ``FLASHATTN_BACKEND`` set for its duration (through
``monkeypatch``, the library reads it at call time).  A test that also takes ``dtype`` is parametrised over
the (backend, dtype) pairs that backend supports on this machine; ``@pytest.mark.dtypes(torch.float32, ...)``
narrows the dtype list for one test.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

BACKENDS = ["torch"] + (["triton"] if (HAS_CUDA or INTERPRET) else [])

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def backend_dtypes(backend: str) -> list[torch.dtype]:
    """The dtypes a backend is tested with on this machine."""
    if is_interpreted(backend):
        # The Triton interpreter emulates bf16 incorrectly (numpy has no bf16), and it is slow: the API tests
        # run it in fp16 only; tests/test_triton_interpret.py runs the kernels in fp16 and fp32.
        return [torch.float16]
    return [torch.float16, torch.bfloat16, torch.float32]


def is_interpreted(backend: str) -> bool:
    """True when ``backend`` runs Triton kernels through the (slow) CPU interpreter."""
    return backend == "triton" and (INTERPRET or not HAS_CUDA)


# Interpreter cost is per tile visited (numpy emulation, ~5 ms a tile), not per flop: a case is skipped on
# the interpreted backend above b * h * ceil(sq / 32) * ceil(sk / 32) tiles (113 x 113 at b = h = 2 is 64);
# tests/test_triton_interpret.py covers the kernels there with chosen multi-tile shapes.
INTERPRET_TILE_BUDGET = 32


def skip_if_too_slow(backend: str, b: int, h: int, sq: int, sk: int, d: int) -> None:
    del d  # the interpreter's cost hardly depends on the head dim
    tiles = b * h * -(-sq // 32) * -(-sk // 32)
    if is_interpreted(backend) and tiles > INTERPRET_TILE_BUDGET:
        pytest.skip("too slow for the Triton interpreter (covered by test_triton_interpret.py and on GPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device with `pytest -m gpu`)")
    config.addinivalue_line("markers", "slow: long-running")
    config.addinivalue_line("markers", "dtypes(*dtypes): restrict the dtypes a backend/dtype test runs with")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_generate_tests(metafunc):
    if "backend" not in metafunc.fixturenames:
        return
    explicit = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0]
        explicit.update(names.replace(" ", "").split(",") if isinstance(names, str) else names)
    if "dtype" not in metafunc.fixturenames or "dtype" in explicit:
        metafunc.parametrize("backend", BACKENDS, indirect=True)
        return
    marker = metafunc.definition.get_closest_marker("dtypes")
    wanted = list(marker.args) if marker else None
    params = []
    for backend in BACKENDS:
        for dtype in backend_dtypes(backend):
            if wanted is None or dtype in wanted:
                params.append(pytest.param(backend, dtype, id=f"{backend}-{_DTYPE_NAMES[dtype]}"))
    metafunc.parametrize(("backend", "dtype"), params, indirect=["backend"])


@pytest.fixture
def backend(request, monkeypatch):
    """The backend name; ``FLASHATTN_BACKEND`` is set to it for the test."""
    monkeypatch.setenv("FLASHATTN_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


# Every test starts from the same RNG state, so a failure reproduces exactly (no reruns).
# FLASHATTN_TEST_SEED=<n> explores other inputs (e.g. to check that a tolerance is not marginal).
SEED = int(os.environ.get("FLASHATTN_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(SEED)
    if HAS_CUDA:
        torch.cuda.manual_seed_all(SEED)
    return SEED
