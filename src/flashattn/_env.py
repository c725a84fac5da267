"""Environment switches read on every call, at a tenth of os.environ.get's cost.

A call reads 8-12 switches (FLASHATTN_* A/B and routing flags, TRITON_INTERPRET), and os.environ.get costs
~1.5 us each (the key's encoding and a Mapping lookup): 10-15% of the host time of a call down to its launch.
On POSIX CPython, os.environ keeps its variables in the bytes dict `_data`, which every write through
os.environ updates (monkeypatch.setenv included), so reading that dict sees the same values. Elsewhere it
falls back to os.environ.get.
"""

import os

_DATA = getattr(os.environ, "_data", None)
_FAST = os.name == "posix" and isinstance(_DATA, dict)


def get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default)."""
    if not _FAST:
        return os.environ.get(name, default)
    value = _DATA.get(name.encode())
    return default if value is None else value.decode("utf-8", "surrogateescape")
