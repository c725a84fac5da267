"""Suite registry. Every module here that defines `SUITE = Suite(...)` is picked up, so adding a suite is
adding a file."""

from __future__ import annotations

import importlib
import pkgutil

from .base import DEFAULT, DRAM, MS, PEAK_MEM, TFLOPS, Suite, View

__all__ = ["DRAM", "MS", "PEAK_MEM", "TFLOPS", "Suite", "View", "all_suites", "get", "lookup"]

_REGISTRY: dict[str, Suite] = {}


def all_suites() -> dict[str, Suite]:
    if not _REGISTRY:
        for info in pkgutil.iter_modules(__path__):
            if info.name.startswith("_") or info.name == "base":
                continue
            suite = getattr(importlib.import_module(f"{__name__}.{info.name}"), "SUITE", None)
            if suite is not None:
                _REGISTRY[suite.name] = suite
    return dict(_REGISTRY)


def get(name: str) -> Suite:
    suites = all_suites()
    try:
        return suites[name]
    except KeyError:
        raise KeyError(f"unknown suite {name!r}; known suites: {', '.join(sorted(suites))}") from None


def lookup(name: str) -> Suite:
    """Like get, but a results file from a suite this install lacks still renders, with default views."""
    return all_suites().get(name, DEFAULT)
