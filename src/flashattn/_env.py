"""Environment switches read on every call, at a tenth of os.environ.get's cost.

A call reads 8-12 switches (FLASHATTN_* A/B and routing flags, TRITON_INTERPRET), and os.environ.get costs
~1.5 us each (the key's encoding and a Mapping lookup): 10-15% of the host time of a call down to its launch.
On POSIX CPython, os.environ keeps its variables in the bytes dict `_data`, which every write through
os.environ updates (monkeypatch.setenv included), so reading that dict sees the same values. Elsewhere it
falls back to os.environ.get.

`snapshot` gives the values of every switch read so far in one tuple, for caches keyed on the switches that
the work they skip would have read (ops/attention.py).
"""

import os
import threading

_DATA = getattr(os.environ, "_data", None)
_FAST = os.name == "posix" and isinstance(_DATA, dict)
_ENCODED: dict[str, bytes] = {}  # every name read so far, and its key in _DATA
_KEYS: tuple = ()  # the same keys in the order first read (replaced, never grown: snapshot iterates it)
_NAMES: tuple = ()
_LOCK = threading.Lock()  # two threads registering at once would each drop the other's name


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default)."""
    key = _ENCODED.get(name)
    if key is None:
        key = _register(name)
    if not _FAST:
        return os.environ.get(name, default)
    value = _DATA.get(key)
    return default if value is None else value.decode("utf-8", "surrogateescape")


def _register(name: str) -> bytes:
    global _KEYS, _NAMES
    with _LOCK:
        key = _ENCODED.get(name)
        if key is None:
            key = name.encode()
            _KEYS, _NAMES = (*_KEYS, key), (*_NAMES, name)
            _ENCODED[name] = key
    return key


def snapshot() -> tuple:
    """The raw values of every name `get` has read so far, in the order first read. A key that holds it
    differs from any key taken before a switch changed or before a name was first read, so a cache entry
    made while a call read a new name is never found again (the next call misses once, and stores anew)."""
    if not _FAST:
        return tuple(map(os.environ.get, _NAMES))
    return tuple(map(_DATA.get, _KEYS))
