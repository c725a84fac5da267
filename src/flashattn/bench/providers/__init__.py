"""Provider registry. Every module here that defines `PROVIDERS = [Provider(...), ...]` is picked up, so
adding a provider is adding a file."""

from __future__ import annotations

import importlib
import pkgutil

from .base import Prepared, Provider

__all__ = ["Prepared", "Provider", "all_providers", "get", "register", "unregister"]

_REGISTRY: dict[str, Provider] = {}
_loaded = False


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for provider in getattr(module, "PROVIDERS", ()):
            register(provider)


def register(provider: Provider, *, replace: bool = False) -> None:
    if provider.name in _REGISTRY and not replace:
        raise ValueError(f"provider {provider.name!r} is registered twice")
    _REGISTRY[provider.name] = provider


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def all_providers() -> dict[str, Provider]:
    _load()
    return dict(_REGISTRY)


def get(name: str) -> Provider:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown provider {name!r}; known providers: {known}") from None
