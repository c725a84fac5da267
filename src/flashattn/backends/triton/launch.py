"""Kernel launches without the JIT's per-call binding: a launch plan per call signature.

`kernel[grid](...)` costs 20-45 us of host time per launch on the H200 machine before the driver sees it
(binding every argument, specialising each one, hashing the options), against 13-23 us for the compiled
kernel's own launcher (scripts/host_profile.py measures both). A training step launches 3-4 attention
kernels per layer, and at N <= 2K that host time outlasts the kernels. `launch` keys a plan on exactly what
Triton 3.6 specialises on, so a plan is reused only where the JIT would pick the same compiled kernel:
  - an int: 1 is a constant; otherwise its width (i32 / i64 / u64) and whether 16 divides it;
  - a tensor (pointer): its dtype and whether its address is 16-byte aligned;
  - a float or bool: its type alone (not specialised);
  - None: a constant (a feature compiled out), so never the plan of a call that passed a value there;
  - a Gluon tensor descriptor: its dtype, block shape and layout (a kernel may take a tile's width from
    its descriptor alone, as the wide-head backwards take dv's);
and on every keyword (constexprs and options such as num_warps). The first call of a signature goes through
the JIT (compiling if needed) and returns the compiled kernel, which the plan keeps. Under TRITON_INTERPRET=1,
without CUDA, with a launch hook installed (profilers), or on a Triton other than the tested release
(flashattn._internals), every call takes the JIT path.

`launch` returns its plan. A launcher that caches its own derivations per call signature
keeps a `Bound` launch (attention.py), which after its first call goes through that plan without computing its
key: the launcher's key must fix every argument's specialisation but the tensors' alignment, which is checked.
"""

from typing import NamedTuple

import torch

from flashattn import _internals, config

_I32 = (-(2**31), 2**31)
_I64_END = 2**63  # past it, an unsigned 64-bit parameter (a dropout seed can be)
_plans: dict = {}


class Plan(NamedTuple):
    compiled: object  # triton's CompiledKernel
    tail: tuple  # the values of the parameters past the positional ones (the constexprs), in order
    device: int  # the CUDA device it was loaded on
    pointers: tuple  # (index, 16-byte aligned) of each tensor argument: what its specialisation saw


def _spec(x):
    # mirrors triton's native_specialize_impl (checked against it in the launch tests); each kind of value
    # has specs of its own, so an argument that changes kind between calls (a softcap's float, then None)
    # never finds the other's plan
    if isinstance(x, float):
        return None
    if isinstance(x, bool):
        return "u1"
    if x is None:
        return "constexpr None"
    if isinstance(x, int):
        return 1 if x == 1 else (x % 16 == 0, _I32[0] <= x < _I32[1], x < _I64_END)
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    # a tensor descriptor: its type is its dtype, block shape and (a Gluon one's) layout; the Triton kernels'
    # host descriptors (triton.tools.tensor_descriptor) have no layout
    base = getattr(x, "base", None)
    return None if base is None else (base.dtype, tuple(x.block_shape), getattr(x, "layout", None))


def same_specialisation(old: tuple, new: tuple) -> bool:
    """Whether two tuples of scalar arguments (no tensors) specialise alike, so that a plan of the one
    serves the other."""
    return all(a == b or _spec(a) == _spec(b) for a, b in zip(old, new, strict=True))


def direct(t: torch.Tensor) -> bool:
    """Whether launches over CUDA tensors like t take plans (as `launch` would): the launchers' caches ask it
    first. A CUDA tensor implies CUDA (torch.cuda.is_available reads the environment on every call)."""
    return (t.is_cuda and _internals.triton_fast() and not config.INTERPRET
            and not _internals.launch_hooks_installed())


def launch(kernel, grid: tuple, *args, **kwargs) -> Plan | None:
    """kernel[grid](*args, **kwargs) for a kernel whose runtime arguments are all positional and whose
    constexprs and options are all keywords, through a cached plan after the first call of its signature.
    Returns the plan, if the call has one."""
    # no CUDA: the interpreter, or scripts/sm90_compile_check.py's compile-only driver on a CPU machine
    if (config.INTERPRET or not _internals.triton_fast() or not torch.cuda.is_available()
            or _internals.launch_hooks_installed()):
        kernel[grid](*args, **kwargs)
        return None
    device = _internals.current_device()
    key = (id(kernel), device, tuple(kwargs.items()), tuple(map(_spec, args)))
    plan = _plans.get(key)
    if plan is None:
        compiled = kernel[grid](*args, **kwargs)
        # the parameters past the positional ones, in order (the constexprs): the compiled launcher takes
        # every parameter, as the JIT hands them on; a plan only when the call names each of them
        tail = kernel.arg_names[len(args):]
        if compiled is not None and all(name in kwargs for name in tail):
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
            pointers = tuple((i, a.data_ptr() % 16 == 0) for i, a in enumerate(args)
                             if isinstance(a, torch.Tensor))
            plan = _plans[key] = Plan(compiled, tuple(kwargs[name] for name in tail), device, pointers)
        return plan
    _run(plan, (*grid, 1, 1), args)
    return plan


def _run(plan: Plan, grid: tuple, args) -> None:
    _internals.run_compiled(plan.compiled, grid, _internals.raw_stream(plan.device), args, plan.tail)


class Bound:
    """A kernel with its grid and keywords fixed, called with positional arguments that specialise alike on
    every call but for the tensors' alignment: through `launch` the first time, then straight through the
    plan it returned while the tensors' alignment and the current device are the plan's. A caller that
    keeps one must key it on everything else the arguments' specialisation depends on, and call it again
    only where `direct` holds (a plan never calls the launch hooks)."""

    __slots__ = ("kernel", "grid", "kwargs", "plan", "grid3")

    def __init__(self, kernel, grid: tuple, kwargs: dict):
        self.kernel, self.grid, self.kwargs = kernel, grid, kwargs
        self.grid3 = (*grid, 1, 1)
        self.plan = None

    def __call__(self, args: tuple) -> None:
        plan = self.plan
        if plan is not None and _internals.current_device() == plan.device:
            for i, aligned in plan.pointers:
                if (args[i].data_ptr() % 16 == 0) is not aligned:
                    break
            else:
                _run(plan, self.grid3, args)
                return
        self.plan = launch(self.kernel, self.grid, *args, **self.kwargs)
