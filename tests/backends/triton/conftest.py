"""Fixtures of the Triton backend's tests: spies that record every call to the Gluon launchers (the GPU
tests, test_gluon_*_gpu.py), and a count of interpreted launches (TRITON_INTERPRET=1), so that a case
asserts the kernel it meant to test really ran."""

import collections

import pytest

from flashattn import config as flashattn_config
from flashattn.backends.triton import attention, decode_routes, gluon, routes


class Calls(list):
    """The q shape of every call to a Gluon launcher; `routes`: the route of each."""

    def __init__(self):
        super().__init__()
        self.routes = []


def spy(monkeypatch, launcher: str) -> Calls:
    """On the Triton backend, the q shape of every call to gluon.<launcher> (a Gluon kernel ran)."""
    monkeypatch.setattr(flashattn_config, "backend", "triton")
    calls = Calls()
    real = getattr(gluon, launcher)

    def record(*args, **kwargs):
        calls.append(args[2].shape)
        calls.routes.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon, launcher, record)
    return calls


@pytest.fixture
def ws_calls(monkeypatch):
    """The Gluon forward's calls (gluon.forward). The Gluon tests run that kernel at every shape: calls of
    few query rows, which the default routes send to the split-KV forward (decode_routes.split_forward_wins;
    test_split_forward*.py test that route), take the Gluon forward's route here, with the launchers'
    signature cache emptied on the way in and out."""
    real = routes.forward_route

    def gluon_forward(spec):
        route = real(spec)
        return routes.gluon_forward_route(spec) if isinstance(route, decode_routes.SplitForward) else route

    monkeypatch.setattr(routes, "forward_route", gluon_forward)
    monkeypatch.setattr(attention, "_forward_cache", {})
    return spy(monkeypatch, "forward")


@pytest.fixture
def ws_bwd_calls(monkeypatch):
    """The Gluon backward's calls (gluon.backward)."""
    return spy(monkeypatch, "backward")


@pytest.fixture
def launches(monkeypatch):
    """Counts interpreted kernel launches by kernel name."""
    from triton.runtime import interpreter

    counts = collections.Counter()
    original = interpreter.GridExecutor.__call__

    def counting_call(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counting_call)
    return counts
