"""The private torch and Triton internals that the host-time fast paths (and the interpreter's cast fix) use,
each behind a version check with the public path as its fallback. Nothing else on the host touches a
private attribute; kernel code that needs a compiler builtin Triton does not export (the Gluon backward's
TMA reduce-add) says so where it is defined, against the pinned triton 3.6.

At short sequence lengths a call's Python outlasts its kernels, so the launch path avoids generic
machinery: autograd.Function.apply's Python wrapper, the Triton JIT's per-launch argument binding, Gluon's
descriptor constructor. Each shortcut below is used only on the versions it was written and tested against
(`TORCH_FAST`, `triton_fast()`); elsewhere the same call goes through the public API, a few microseconds
slower.
"""

from __future__ import annotations

import functools

import torch

TESTED_TORCH = ((2, 11), (2, 13))  # [first, last] (major, minor): the H200's torch and CI's
TESTED_TRITON = (3, 6)  # the Triton release whose launcher and specialisation the launch plans mirror


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _torch_fast() -> bool:
    ok = TESTED_TORCH[0] <= _version(torch.__version__) <= TESTED_TORCH[1]
    c = torch._C
    return ok and hasattr(c, "_functorch") and hasattr(c._functorch, "unwrap_if_dead") and hasattr(
        c, "_are_functorch_transforms_active")


TORCH_FAST = _torch_fast()


def function_apply(cls: type[torch.autograd.Function], n_tensors: int):
    """`cls.apply` without its generic Python steps: Function.apply checks for a setup_context and unwraps
    dead functorch wrappers through a generator over every argument (~1-2 us); the returned callable unwraps
    the first n_tensors arguments (tensors or None) and passes the rest on as they are, calling the C++ apply
    directly. Falls back to cls.apply when functorch transforms are active or torch is not a tested
    version."""
    if not TORCH_FAST:
        return cls.apply
    from torch._C._functorch import unwrap_if_dead

    c_apply = super(torch.autograd.Function, cls).apply  # the C++ apply that Function.apply ends in
    active = torch._C._are_functorch_transforms_active
    public = cls.apply

    def apply(*args):
        if active():
            return public(*args)
        head = [a if a is None else unwrap_if_dead(a) for a in args[:n_tensors]]
        return c_apply(*head, *args[n_tensors:])

    return apply


@functools.cache
def triton_fast() -> bool:
    """Whether the installed Triton is the release the launch plans mirror (asked on first use: importing
    flashattn does not import Triton)."""
    try:
        import triton
    except ImportError:
        return False
    return _version(triton.__version__) == TESTED_TRITON


def patch_interpreter_casts(wrap) -> bool:
    """Replace the float narrowing of Triton's interpreter (the private
    `triton.runtime.interpreter._convert_float`) with `wrap(original)`, once, on the tested Triton only.
    False where it is left alone (another Triton, or the function is gone): the interpreter's own casts
    stay."""
    if not triton_fast():
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        return False
    if not getattr(original, "flashattn_fixed", False):
        interpreter._convert_float = wrap(original)
    return True


def current_device() -> int:
    """torch.cuda.current_device() without its lazy-init check (the caller has CUDA tensors)."""
    return torch._C._cuda_getDevice() if TORCH_FAST else torch.cuda.current_device()


def raw_stream(device: int) -> int:
    """The current CUDA stream of `device` as the integer handle Triton's launcher takes."""
    if TORCH_FAST:
        return torch._C._cuda_getCurrentRawStream(device)
    return torch.cuda.current_stream(device).cuda_stream


_knobs = None


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook is installed (profilers): launch plans bypass the hooks, so they step
    aside while one is. Triton 3.6 keeps hooks in chains that are empty by default."""
    global _knobs
    if _knobs is None:  # imported once: an import statement costs host time on every call
        from triton import knobs

        _knobs = knobs
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def run_compiled(compiled, grid: tuple, stream: int, args: tuple, tail: tuple) -> None:
    """Launch a compiled Triton kernel (Triton 3.6's CompiledKernel) as its JIT would, given every runtime
    argument in order and the constexprs' values (`tail`)."""
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None,
                 None, *args, *tail)


def descriptor_factory():
    """A function (base, shape, strides, block_shape, layout) -> Gluon host tensor descriptor. On the tested
    Triton it sets the dataclass's fields directly, skipping the constructor's checks (~3 of the ~5 us
    each, 4-7 per launch): the launchers hand it tensors they checked or allocated contiguous."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if not triton_fast():
        return lambda base, shape, strides, block_shape, layout: TensorDescriptor(
            base, shape, strides, block_shape, layout)

    def make(base, shape, strides, block_shape, layout):
        d = object.__new__(TensorDescriptor)
        d.base, d.shape, d.strides, d.block_shape, d.layout, d.padding = (
            base, shape, strides, block_shape, layout, "zero")
        return d

    return make


def _fill_tma_descriptor():
    import triton

    return triton.runtime.driver.active.utils.fill_tma_descriptor


def direct_launch(compiled, descriptors: tuple):
    """A launch function for a compiled kernel whose first len(descriptors) parameters are TMA tensor
    descriptors, or None where this Triton's launcher is not the one it was written for.

    descriptors: one (shape, strides) per descriptor parameter (block shape and layout are fixed by the
    kernel's constexprs, which the compiled kernel's metadata carries). The returned launch(grid3, stream,
    bases, rest) takes the descriptors' base tensors and every later parameter (constexprs included), fills
    each descriptor itself and calls the launcher's C entry point: the per-launch Python of Triton 3.6's
    wrapper (re-reading each descriptor's metadata, building its argument list, the scratch allocators) costs
    ~1.5-2 us a descriptor, and the Gluon backward takes eight."""
    if not triton_fast():
        return None
    runner = compiled.run
    inner = getattr(runner, "launch", None)
    free = getattr(getattr(inner, "__code__", None), "co_freevars", ())
    if (getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1)
            or not {"launcher", "tensordesc_meta", "tensordesc_indices"} <= set(free)):
        return None
    cells = {name: cell.cell_contents for name, cell in zip(free, inner.__closure__, strict=True)}
    metas, indices = cells["tensordesc_meta"], cells["tensordesc_indices"]
    if sorted(indices) != list(range(len(descriptors))) or len(metas) != len(descriptors):
        return None
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    fixed = []  # per descriptor: the fill arguments after the base pointer, then shape and strides again
    for meta, (shape, strides) in zip(metas, descriptors, strict=True):
        if meta is None or meta.get("fp4_padded"):
            return None
        shape, strides = list(shape), list(strides)
        fixed.append(((meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                       meta["block_size"], shape, strides, 0), (*shape, *strides)))
    c_launch, fill = cells["launcher"], _fill_tma_descriptor()
    head = (compiled.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None)

    def launch(grid, stream, bases, rest):
        args = []
        for base, (fill_args, extra) in zip(bases, fixed, strict=True):
            args.append(fill(base.data_ptr(), *fill_args))
            args.extend(extra)
        c_launch(grid[0], grid[1], grid[2], stream, *head, *args, *rest)

    return launch
