"""What a user may override, in one place. Nothing else in the library reads the environment.

Each setting starts from an environment variable read once, when flashattn is imported, and can be changed
later with the setter below it (which is how tests and benchmarks change it). Which kernel a call runs is
otherwise a pure function of the call (`flashattn.backends.triton.routes`), never of process state.

backend (FLASHATTN_BACKEND=triton|torch; set_backend, use_backend)
    Force the Triton kernels or the chunked pure-PyTorch backend. Default: Triton for CUDA tensors (and CPU
    tensors under TRITON_INTERPRET=1), torch otherwise.
tile overrides (FLASHATTN_CONFIG="fwd=128,64,8,3;dq=..."; set_tiles, use_tiles)
    Replace rows of the tile table (experts, tuning): kernel=block_m,block_n,num_warps,num_stages[,maxnreg]
    for kernel in fwd, dkdv, dq, fwd_ws, bwd_ws, decode, decode_paged.
index checks (FLASHATTN_CHECK_INDICES=1; set_check_indices, use_check_indices; off by default)
    flash_attn_with_kvcache (unless its check_inputs says otherwise), DecodePlan.run and the paged varlen
    call check the values of the cache indices against the cache shapes, with one device-to-host copy per
    call. Off, nothing synchronises: the kernels clamp every index, so a bad value gives a wrong result,
    never an access out of bounds (docs/decode.md).
varlen checks (set_check_varlen, use_check_varlen; off by default, no environment variable)
    The varlen functions check the values of CUDA cu_seqlens (first 0, non-decreasing, within the packed
    tensor, no sequence longer than max_seqlen) with one device-to-host copy per call. Off, the kernels clamp
    every row they derive from cu_seqlens, so a bad value gives wrong rows but never an out-of-bounds access;
    CPU cu_seqlens are always checked (reading host memory costs no sync).

`TRITON_INTERPRET=1` is Triton's own switch: Triton reads it when the kernels are defined, so it must be set
before flashattn is imported; flashattn reads it at the same moment (`INTERPRET`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from flashattn.errors import FlashAttnError

BACKENDS = ("triton", "torch")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

backend: str | None = None  # None: chosen per call by the tensors' device
tile_overrides: dict = {}  # kernel name -> TileConfig (flashattn.backends.triton.configs)
check_indices: bool = False
check_varlen: bool = False
# bumped by every change of a setting that a launcher's cached derivations depend on (the tile overrides): the
# launchers key their caches on it
generation: int = 0


def set_backend(name: str | None) -> None:
    """Force a backend for every later call ("triton" or "torch"), or None for the automatic choice."""
    global backend
    if name is not None:
        name = name.strip().lower() or None
    if name is not None and name not in BACKENDS:
        raise FlashAttnError(f"the backend (FLASHATTN_BACKEND, flashattn.config.set_backend) is {name!r}; "
                             f"expected one of {', '.join(BACKENDS)}, or None for the automatic choice")
    backend = name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """set_backend(name) for the duration of a with-block."""
    old = backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def parse_tiles(text: str) -> dict:
    """`"fwd=128,64,8,3;dq=128,64,8,2"` -> {"fwd": TileConfig(128, 64, 8, 3), ...}."""
    from flashattn.backends.triton.configs import TileConfig

    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, spec = part.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = TileConfig.parse(spec)
        except (TypeError, ValueError):
            raise FlashAttnError(
                f"tile override {part!r}: expected kernel=block_m,block_n,num_warps,num_stages[,maxnreg]"
            ) from None
    return out


def set_tiles(spec: str | dict | None) -> None:
    """Replace rows of the tile table: a FLASHATTN_CONFIG string, a {kernel: TileConfig} dict, or None."""
    global tile_overrides, generation
    if spec is None:
        spec = {}
    tile_overrides = parse_tiles(spec) if isinstance(spec, str) else dict(spec)
    generation += 1


@contextlib.contextmanager
def use_tiles(spec: str | dict | None) -> Iterator[None]:
    """set_tiles(spec) for the duration of a with-block."""
    old = tile_overrides
    set_tiles(spec)
    try:
        yield
    finally:
        set_tiles(old)


def set_check_indices(on: bool) -> None:
    global check_indices
    check_indices = bool(on)


@contextlib.contextmanager
def use_check_indices(on: bool) -> Iterator[None]:
    """set_check_indices(on) for the duration of a with-block."""
    old = check_indices
    set_check_indices(on)
    try:
        yield
    finally:
        set_check_indices(old)


def set_check_varlen(on: bool) -> None:
    global check_varlen
    check_varlen = bool(on)


@contextlib.contextmanager
def use_check_varlen(on: bool) -> Iterator[None]:
    """set_check_varlen(on) for the duration of a with-block."""
    old = check_varlen
    set_check_varlen(on)
    try:
        yield
    finally:
        set_check_varlen(old)


def _from_environment() -> None:
    set_backend(os.environ.get("FLASHATTN_BACKEND") or None)
    text = os.environ.get("FLASHATTN_CONFIG", "")
    if text.strip():
        set_tiles(text)
    set_check_indices(os.environ.get("FLASHATTN_CHECK_INDICES", "0").strip() not in ("", "0"))


_from_environment()
