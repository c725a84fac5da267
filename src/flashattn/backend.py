"""Which implementation runs a call: the Triton kernels or the chunked pure-PyTorch algorithm.

`triton` serves CUDA tensors, and CPU tensors when the process runs under TRITON_INTERPRET=1 (how CI tests the
kernels); `torch` serves every other CPU tensor. FLASHATTN_BACKEND=triton|torch forces one; it is read at call
time.
"""

import functools
import importlib

import torch

from flashattn import _env

BACKENDS = ("triton", "torch")


def backend_name(t: torch.Tensor) -> str:
    forced = _env.get("FLASHATTN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"FLASHATTN_BACKEND is {forced!r}; expected one of {', '.join(BACKENDS)}")
        if forced == "triton" and not t.is_cuda and _env.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"FLASHATTN_BACKEND=triton but the tensors are on {t.device}: the Triton kernels need a CUDA "
                f"device, or TRITON_INTERPRET=1 set before the process starts to interpret them on the CPU"
            )
        return forced
    if t.is_cuda or _env.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "torch"


def backend_module(t: torch.Tensor):
    """The module whose attention_forward / attention_backward serve tensors like `t`."""
    return _module("flashattn.ops.attention" if backend_name(t) == "triton" else "flashattn.torch_backend")


@functools.cache
def _module(name: str):
    # imported on first use (the torch backend needs no Triton), then looked up: an import statement costs
    # ~0.4 us on every call
    return importlib.import_module(name)
