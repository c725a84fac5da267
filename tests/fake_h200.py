"""A faked H200 for the Triton backend's host paths on the CPU: the device facts routing reads, the SM
count and the CUDA stream faked, and every kernel replaced by a recorder whose compiled kernel's launcher
records instead of launching, so that the whole path down to `compiled.run` runs
(tests/backends/triton/test_signature_cache.py, test_block_sparse_launch.py)."""

import gc
import types

import torch

import flashattn.kernels.gluon.attn_bwd as bwd_ws_kernels
import flashattn.kernels.gluon.attn_fwd as fwd_ws_kernels
import flashattn.kernels.triton.tiles as tile_kernels
from flashattn import _internals, _validate, backends, config
from flashattn.backends.triton import attention, block_sparse, gluon, tma
from flashattn.backends.triton import launch as launch_mod


class Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log, name):
        self.log, self.name = log, name

    def run(self, *args):
        self.log.append(("run", self.name, args))


class Kernel:
    """Stands for a JITFunction: kernel[grid](...) is recorded and returns a compiled kernel (one per call,
    so that a launch through a plan shows which JIT call made it)."""

    def __init__(self, real, log):
        self.arg_names, self.name, self.log = real.arg_names, real.__name__, log

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("jit", self.name, (grid, args, kwargs)))
            return Compiled(self.log, self.name)

        return call


def install(monkeypatch) -> list:
    """Fake the H200 (for the monkeypatch's scope); returns the launch log: ("jit", kernel, (grid, args,
    kwargs)) or ("run", kernel, compiled.run's args)."""
    log = []
    monkeypatch.setattr(config, "INTERPRET", False)
    monkeypatch.setattr(config, "tile_overrides", {})
    monkeypatch.setattr(backends, "backend_name", lambda t: "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_internals, "current_device", lambda: 0)
    monkeypatch.setattr(_internals, "raw_stream", lambda device: 1234)
    # CPU tensors stand for CUDA ones on an H200: the gate as launch.direct, less its is_cuda
    monkeypatch.setattr(launch_mod, "direct", lambda t: not _internals.launch_hooks_installed())
    monkeypatch.setattr(tma, "device_facts", lambda device: (True, (9, 0)))
    monkeypatch.setattr(gluon, "sm_count", lambda device: 132)
    for module, name in ((fwd_ws_kernels, "attn_fwd_ws_kernel"), (bwd_ws_kernels, "attn_bwd_ws_kernel"),
                         (attention, "attn_bwd_preprocess_kernel"), (attention, "attn_fwd_kernel"),
                         (attention, "attn_bwd_kernel"), (tile_kernels, "varlen_tile_offsets_kernel")):
        monkeypatch.setattr(module, name, Kernel(getattr(module, name), log))
    monkeypatch.setattr(attention, "_forward_cache", {})
    monkeypatch.setattr(attention, "_backward_cache", {})
    monkeypatch.setattr(block_sparse, "_route_cache", {})
    monkeypatch.setattr(block_sparse, "_forward_cache", {})
    monkeypatch.setattr(launch_mod, "_plans", {})
    monkeypatch.setattr(_validate, "_passed", set())
    return log


def launches(log, names) -> list:
    """The log's launches as (kernel, grid, every parameter's value in order): a JIT call and a launch through
    a plan compare equal when they hand the kernel the same things. A tensor shows as the input it is (by
    address) or "new", with its dtype, shape and strides; a descriptor as its fields."""
    kernels = {"attn_fwd_ws_kernel": fwd_ws_kernels, "attn_bwd_ws_kernel": bwd_ws_kernels,
               "sparse_fwd_kernel": block_sparse, "sparse_bwd_kernel": block_sparse,
               "varlen_tile_offsets_kernel": tile_kernels}

    def show(a):
        if isinstance(a, torch.Tensor):
            return names.get(a.data_ptr(), "new"), a.dtype, tuple(a.shape), a.stride()
        if hasattr(a, "block_shape"):
            layout = getattr(a, "layout", None)  # Triton's own descriptors (the Triton kernels') have none
            return ("desc", show(a.base), a.shape, a.strides, a.block_shape, layout, a.padding)
        return a

    out = []
    for kind, name, call in log:
        if kind == "jit":
            grid, args, kwargs = call
            arg_names = getattr(kernels.get(name, attention), name).arg_names
            params = (*args, *(kwargs[n] for n in arg_names[len(args):]))
            out.append((name, (*grid, 1, 1)[:3], tuple(map(show, params))))
        else:
            assert call[3:9] == (1234, "function", "metadata", None, None, None)
            out.append((name, call[:3], tuple(map(show, call[9:]))))
    return out


def objects_reached(*roots) -> int:
    """How many objects the roots (caches) reach, short of code (kernels, classes, modules, functions) and
    the fake's recorders, whose log keeps the launched tensors; asserts that none of them is a tensor."""
    skip = (Kernel, Compiled, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen, stack = set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        assert not isinstance(obj, torch.Tensor), "a cache holds a tensor"
        stack.extend(gc.get_referents(obj))
    return len(seen)
