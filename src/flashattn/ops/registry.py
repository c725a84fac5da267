"""The one helper every op of the library is made with: a torch.library custom op (namespace `flashattn::`)
with its fake implementation and autograd, plus the eager fast path.

Under torch.compile a call goes through the registered op, so the compiler traces it without a graph break
and sees its fake (shape-only) implementation. An eager call skips the custom-op dispatch, whose host cost
(~0.1-0.3 ms with autograd, O(args²) schema binding for an op that mutates its inputs) exceeds the whole
kernel time of small problems: it calls the implementation directly, through an autograd.Function made from
the same setup_context and backward when a differentiable input needs a gradient. One backward serves both
paths: inside it, calling another Op (the backward op) takes the registered op while compiling and the plain
implementation otherwise. "Compiling" is asked of the first argument too: while AOTAutograd traces the
joint graph (torch.compile's backward, aot_function, export) torch.compiler.is_compiling() can be False,
and the tensors are then FakeTensor / FunctionalTensor subclasses, which a kernel cannot launch on.

    attn_bwd = Op("attn_bwd", bwd_impl, fake=bwd_fake)
    attn_fwd = Op("attn_fwd", fwd_impl, fake=fwd_fake)
    attn_fwd.register_autograd(backward, setup_context, differentiable=("q", "k", "v"),
                               non_differentiable_outputs=(1, 2))
    out, lse, rng = attn_fwd(q, k, v, ...)   # every argument positional, in the implementation's order
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Iterator, Sequence

import torch

from flashattn import _internals

NAMESPACE = "flashattn"
_registered_only = False  # through_registered_ops() is active


@contextlib.contextmanager
def through_registered_ops() -> Iterator[None]:
    """Every op call inside takes the registered torch.library op, as under torch.compile (for tests of the
    registrations, and to see what the compiler sees)."""
    global _registered_only
    old, _registered_only = _registered_only, True
    try:
        yield
    finally:
        _registered_only = old


def eager(t: torch.Tensor) -> bool:
    """Whether a call on t now takes the eager fast paths (not while torch.compile or AOTAutograd traces,
    nor inside through_registered_ops): the public functions that keep prepared launches of their own ask
    it."""
    return not (_registered_only or type(t) is not torch.Tensor or torch.compiler.is_compiling())


class Op:
    """A registered op and its eager fast path; call it with every argument positional."""

    def __init__(self, name: str, impl: Callable, *, fake: Callable, mutates_args: Sequence[str] = ()):
        self.name = f"{NAMESPACE}::{name}"
        self.impl = impl
        self.params = tuple(inspect.signature(impl).parameters)
        self.library_op = torch.library.custom_op(self.name, impl, mutates_args=tuple(mutates_args))
        self.library_op.register_fake(fake)
        self._apply = None  # the eager autograd.Function's apply, once register_autograd made one
        self._differentiable: tuple[int, ...] = ()
        self._pick = None  # args -> the differentiable ones, as a tuple

    def register_autograd(self, backward: Callable, setup_context: Callable, *,
                          differentiable: Sequence[str], non_differentiable_outputs: Sequence[int] = (),
                          eager_function: bool = True) -> None:
        """backward(ctx, *grad_outputs) -> one gradient (or None) per op input, in order;
        setup_context(ctx, inputs, output) saves what backward needs. differentiable: the names of the tensor
        inputs that can need a gradient (a call where none does runs without an autograd node).
        eager_function=False: an op whose differentiable inputs are lists of tensors (which an
        autograd.Function does not track) takes the registered op in eager calls that need gradients."""
        self.library_op.register_autograd(backward, setup_context=setup_context)
        self._differentiable = tuple(self.params.index(n) for n in differentiable)
        pick = operator.itemgetter(*self._differentiable)
        self._pick = pick if len(self._differentiable) > 1 else (lambda args: (pick(args),))
        if eager_function:
            self._apply = _internals.function_apply(
                _eager_function(self.name, self.impl, backward, setup_context, self._differentiable,
                                tuple(non_differentiable_outputs)), len(self._differentiable))
        else:
            self._apply = self.library_op

    def __call__(self, *args):
        # a tensor subclass (a tracer's, or a user's such as nn.Parameter) takes the registered op, whose
        # dispatch handles it; merge's first argument is a list of tensors
        first = args[0]
        if type(first) is list and first:
            first = first[0]
        if _registered_only or type(first) is not torch.Tensor or torch.compiler.is_compiling():
            return self.library_op(*args)
        if self._apply is not None and torch.is_grad_enabled() and self._needs_grad(args):
            if self._apply is self.library_op:
                return self.library_op(*args)
            # the differentiable tensors as the Function's own inputs (autograd tracks those), then every
            # argument in one tuple: apply's host time grows with its argument count (~0.5 us each)
            return self._apply(*self._pick(args), args)
        return self.impl(*args)

    def _needs_grad(self, args) -> bool:
        for i in self._differentiable:
            a = args[i]
            if isinstance(a, torch.Tensor):
                if a.requires_grad:
                    return True
            elif isinstance(a, (list, tuple)) and any(t.requires_grad for t in a):
                return True
        return False


def _eager_function(name: str, impl: Callable, backward: Callable, setup_context: Callable,
                    differentiable: tuple[int, ...], non_differentiable_outputs: tuple[int, ...]):
    """An autograd.Function computing impl with the op's own setup_context and backward."""

    def forward(ctx, *inputs):
        args = inputs[-1]
        output = impl(*args)
        setup_context(ctx, args, output)
        if non_differentiable_outputs:
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable_outputs))
            # the backward reads no gradient of those outputs: without this the engine would fill a zero
            # tensor for each of them on every backward (an allocation and a fill kernel)
            ctx.set_materialize_grads(False)
        return output

    def eager_backward(ctx, *grads):
        full = backward(ctx, *grads)
        return (*(full[i] for i in differentiable), None)

    short = name.split("::")[-1]
    return type(f"Eager_{short}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)})
