"""Shared pytest configuration: markers, backend/dtype parametrisation, seeding.

Backends under test:
  * ``torch``  -- always (pure PyTorch, runs on whatever device the tensors live on).
  * ``triton`` -- on CUDA, or on CPU when the process was started with ``TRITON_INTERPRET=1``
    (the Triton interpreter; slow, and it computes bf16 wrong, so fp16 only there, see backend_dtypes).

A test that takes the ``backend`` fixture gets that backend forced for its duration
(``flashattn.config.use_backend``).  A test that also takes ``dtype`` is parametrised over
the (backend, dtype) pairs that backend supports on this machine; ``@pytest.mark.dtypes(torch.float32, ...)``
narrows the dtype list for one test.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest
import torch
from utils import BACKENDS, DEVICE, DTYPE_NAMES, HAS_CUDA, backend_dtypes

from flashattn import config as flashattn_config


def pytest_addoption(parser):
    parser.addoption("--results-log", metavar="PATH", default=None,
                     help="append each test's outcome, duration and (on failure) the end of its report to "
                          "PATH as it finishes: a run cut off by a time limit still says what failed and why")
    parser.addoption("--shard", metavar="I/N", default=None,
                     help="run the I-th of N interleaved shares of the selected tests (1 <= I <= N): a suite "
                          "longer than one device call runs as N calls, each with a mix of every file")


def pytest_runtest_logreport(report):
    path = _RESULTS_LOG.get("path")
    if path is None or not (report.when == "call" or report.outcome != "passed"):
        return
    lines = [f"{report.outcome.upper()} {report.when} {report.duration:.1f}s {report.nodeid}"]
    if report.failed:
        lines += ["    " + line for line in report.longreprtext.splitlines()[-15:]]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


_RESULTS_LOG: dict = {}


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # under xdist the controller writes (it gets every report)
        _RESULTS_LOG["path"] = config.getoption("--results-log")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device with `pytest -m gpu`)")
    config.addinivalue_line("markers", "slow: long-running")
    config.addinivalue_line("markers", "dtypes(*dtypes): restrict the dtypes a backend/dtype test runs with")
    config.addinivalue_line("markers", "big_memory: needs tens of GiB of GPU memory (its float64 oracle): "
                                       "such tests run one at a time across xdist workers")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: --shard cuts its shares from what will run
def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    value = config.getoption("--shard")
    if value is None:
        return
    # --shard I/N: every N-th test from the I-th, in collection order
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard is {value!r}; expected I/N with 1 <= I <= N, e.g. 2/3")
    keep = items[i - 1::n]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


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
                params.append(pytest.param(backend, dtype, id=f"{backend}-{DTYPE_NAMES[dtype]}"))
    metafunc.parametrize(("backend", "dtype"), params, indirect=["backend"])


@pytest.fixture
def backend(request):
    """The backend name, forced for the test."""
    with flashattn_config.use_backend(request.param):
        yield request.param


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _one_big_memory_test_at_a_time(request):
    # xdist workers share the one GPU: several float64 oracles of 16K-token problems at once ran it out of
    # memory. An exclusive lock on one file serialises the marked tests; each returns its cached blocks so
    # that the next one (in another process) can have them. The other tests return theirs past
    # _CACHE_KEPT: seven workers' caching allocators held 1.6-12 GiB each of free blocks and left a big test
    # 1.2 GiB of an 80 GiB card.
    if not HAS_CUDA:
        yield
        return
    if request.node.get_closest_marker("big_memory") is None:
        yield
        if torch.cuda.memory_reserved() > _CACHE_KEPT:
            torch.cuda.empty_cache()
        return
    with open(os.path.join(tempfile.gettempdir(), "flashattn-big-memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


_CACHE_KEPT = 2 << 30  # bytes of a worker's cached GPU blocks kept between tests


# Every test starts from the same RNG state, so a failure reproduces exactly (no reruns).
# FLASHATTN_TEST_SEED=<n> explores other inputs (e.g. to check that a tolerance is not marginal).
SEED = int(os.environ.get("FLASHATTN_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(SEED)
    if HAS_CUDA:
        torch.cuda.manual_seed_all(SEED)
    return SEED
