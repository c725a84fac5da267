"""Kernel launches without the JIT's per-call binding: a launch plan per call signature.

`kernel[grid](...)` costs 20-45 us of host time per launch on the H200 machine before the driver sees it
(binding every argument, specialising each one, hashing the options), against 13-23 us for the compiled
kernel's own launcher (results/h200-2026-11-29-s10/host-profile). A training step launches 3-4 attention
kernels per layer, and at N <= 2K that host time outlasts the kernels (NOTES v25). `launch` keys a plan on
exactly what Triton 3.6 specialises on, so a plan is reused only where the JIT would pick the same compiled
kernel:
  - an int: 1 is a constant; otherwise its width (i32 / i64 / u64) and whether 16 divides it;
  - a tensor (pointer): its dtype and whether its address is 16-byte aligned;
  - a float or bool: nothing (not specialised);
  - a Gluon tensor descriptor: its dtype, block shape and layout, which the call's constexprs fix (the
    launchers build them from the config), and its dtype is in the key;
and on every keyword (constexprs and options such as num_warps). The first call of a signature goes through
the JIT (compiling if needed) and returns the compiled kernel, which the plan keeps. Under TRITON_INTERPRET=1,
without CUDA, or with a launch hook installed (profilers), every call takes the JIT path.
"""

import torch

from flashattn import _env

_I32 = (-(2**31), 2**31)
_I64_END = 2**63  # past it, an unsigned 64-bit parameter (a dropout seed can be)
_plans: dict = {}


def _spec(x):
    # mirrors triton's native_specialize_impl (checked against it in tests/test_launch.py)
    if isinstance(x, bool) or isinstance(x, float):
        return None
    if isinstance(x, int):
        return 1 if x == 1 else (x % 16 == 0, _I32[0] <= x < _I32[1], x < _I64_END)
    if isinstance(x, torch.Tensor):
        return x.dtype, x.data_ptr() % 16 == 0
    base = getattr(x, "base", None)  # a tensor descriptor: its type comes from the constexprs and the dtype
    return None if base is None else base.dtype


def _hooked() -> bool:
    """Whether a launch hook is installed: Triton 3.6 keeps them in chains that are empty by default (the
    JIT still calls the empty chains, and builds their metadata, on every launch)."""
    from triton import knobs

    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs) for a kernel whose runtime arguments are all positional and whose
    constexprs and options are all keywords, through a cached plan after the first call of its signature."""
    # no CUDA: the interpreter, or scripts/sm90_compile_check.py's compile-only driver on a CPU machine
    if _env.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() or _hooked():
        kernel[grid](*args, **kwargs)
        return
    device = torch.cuda.current_device()
    key = (id(kernel), device, tuple(kwargs.items()), tuple(map(_spec, args)))
    plan = _plans.get(key)
    if plan is None:
        compiled = kernel[grid](*args, **kwargs)
        # the parameters past the positional ones, in order (the constexprs): the compiled launcher takes
        # every parameter, as the JIT hands them on; a plan only when the call names each of them
        tail = kernel.arg_names[len(args):]
        if compiled is not None and all(name in kwargs for name in tail):
            _plans[key] = (compiled.result() if hasattr(compiled, "result") else compiled, tail)
        return
    compiled, tail = plan
    g = (*grid, 1, 1)
    compiled.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *[kwargs[name] for name in tail])
