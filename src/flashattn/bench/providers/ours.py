"""`flashattn` (this project, through its public API, with the case's window, packing, softcap and sink) and,
for A/B timing, the same attention on other routes (flashattn.backends.triton.routes): through the launchers
with an explicit route, `flashattn-triton` (the Triton kernels forward and backward), `flashattn-ptr` (the
Triton kernels on pointer loads, no TMA descriptors), `flashattn-headmajor` (the default routes with the
launch order head by head), `flashattn-ws-tiles` (the Gluon forward on one program per query tile instead of
its persistent grid), `flashattn-fwd-k{32,64,64s3,128}` (the Gluon forward on key steps of that width and
2 or 3 K/V stages, with the Q buffers that fit beside them), `flashattn-bwd-split{2,4,8}` (the Gluon
backward's GQA group in parts),
`flashattn-deterministic` (its fixed-order dQ variant, as deterministic=True takes it); through the
public call, every option included, `flashattn-triton-bwd` (with the
Triton backward); and `torch-backend` (its pure-PyTorch backend)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator

import torch

from ..case import Case
from .base import Prepared, Provider, first_tensor, make_leaves
from .features import _require_packed, cu_seqlens


def flash_attn_options(case: Case, device: torch.device) -> dict:
    """The case's window, softcap and learnable sink as flash_attn's keywords; none at all for a plain case,
    so that the call every other suite times is the one it always was."""
    options: dict = {}
    if case.window != (-1, -1):
        options["window_size"] = case.window
    if case.softcap:
        options["softcap"] = case.softcap
    sink = case.learnable_sink(device, requires_grad=True)
    if sink is not None:
        options["learnable_sink"] = sink
    return options


def routes_info(q, k, v, package: str = "flashattn", **call) -> dict:
    """`route_fwd` / `route_bwd`: the kernel families a public call on these tensors runs (routes.Spec's
    default routes, e.g. GluonForward / TritonBackward), or "torch" on the pure-PyTorch backend: a result
    row then says which kernels it timed, so a call that fell back to the slower kernels shows as such.
    package: the importable name of the build asked (`flashattn`, or a vendored copy's)."""
    backends = importlib.import_module(f"{package}.backends")
    if backends.backend_name(q) != "triton":
        return {"route_fwd": "torch", "route_bwd": "torch"}
    attention = importlib.import_module(f"{package}.backends.triton.attention")
    routes = importlib.import_module(f"{package}.backends.triton.routes")

    # dout's alignment counts for the backward's route too: the runner's is contiguous like q
    spec = attention.spec_of(q, k, v, **call)
    return {"route_fwd": type(routes.forward_route(spec)).__name__,
            "route_bwd": type(routes.backward_route(spec)).__name__}


def _setup_public(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  package: str = "flashattn") -> Prepared:
    """The public call (flash_attn_varlen_func on packed cases) of `package`: this tree's, or a vendored
    copy's (`flashattn-baseline`)."""
    flashattn = importlib.import_module(package)
    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    options = flash_attn_options(case, q.device)
    routed = {key: options[key] for key in ("window_size", "softcap", "learnable_sink") if key in options}
    if case.lengths is not None:
        # packed documents: the public varlen call, one cu_seqlens for q and k (as flashattn-varlen)
        lengths = _require_packed(case)
        cu, longest = cu_seqlens(lengths, q.device), max(lengths)
        info = routes_info(qb[0], kb[0], vb[0], package, causal=case.causal, cu_seqlens_q=cu,
                           max_seqlen_q=longest, max_seqlen_k=longest, **routed)

        def fwd() -> torch.Tensor:
            # the (1, total, h, d) leaves indexed to (total, h, d): views, so the timed call copies nothing
            out = flashattn.flash_attn_varlen_func(
                qb[0], kb[0], vb[0], cu, cu, longest, longest, causal=case.causal, **options
            )
            return first_tensor(out).unsqueeze(0)

        return Prepared(fwd=fwd, leaves=leaves, info=info)
    return Prepared(
        fwd=lambda: first_tensor(flashattn.flash_attn_func(qb, kb, vb, causal=case.causal, **options)),
        leaves=leaves, info=routes_info(qb, kb, vb, package, causal=case.causal, **routed),
    )


def _setup_torch_backend(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    from flashattn import config

    prepared = _setup_public(case, q, k, v)
    prepared.context = lambda: config.use_backend("torch")
    return prepared


@contextlib.contextmanager
def _triton_backward() -> Iterator[None]:
    """Public calls take the Triton backward while inside: routes.backward_route swapped for the bench's
    duration (the launchers look it up per call), their signature cache emptied on the way in and out."""
    from flashattn.backends.triton import attention, routes

    real = routes.backward_route
    routes.backward_route = routes.triton_backward_route
    attention._backward_cache.clear()
    try:
        yield
    finally:
        routes.backward_route = real
        attention._backward_cache.clear()


def _setup_triton_backward(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    with _triton_backward():  # the row's route_bwd says what runs
        prepared = _setup_public(case, q, k, v)
    prepared.context = _triton_backward
    return prepared


class _Routed(torch.autograd.Function):
    """The dense launchers forward and backward on fixed routes (no validation: the bench's inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, options: dict, routes: tuple):
        from flashattn.backends.triton import attention

        out, lse = attention.attention_forward(q, k, v, route=routes[0], **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options, ctx.route = options, routes[1]
        return out

    @staticmethod
    def backward(ctx, dout):
        from flashattn.backends.triton import attention

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, _ = attention.attention_backward(dout, q, k, v, out, lse, route=ctx.route, **ctx.options)
        return dq, dk, dv, None, None


def routed(forward: Callable, backward: Callable) -> Callable[..., Prepared]:
    """A provider setup running the case on forward(spec) / backward(spec) routes, spec being the call's
    (flashattn.backends.triton.attention.spec_of); each function returns a route."""

    def setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        from flashattn.backends.triton import attention

        leaves = make_leaves(q, k, v, "bshd")
        spec = attention.spec_of(*leaves, causal=case.causal, dout=leaves[0])
        options = dict(softmax_scale=q.shape[-1] ** -0.5, causal=case.causal)
        chosen = (forward(spec), backward(spec))
        return Prepared(fwd=lambda: _Routed.apply(*leaves, options, chosen), leaves=leaves)

    return setup


def _replace(route_fn: Callable, kind: type | None = None, **fields) -> Callable:
    """route_fn's route with fields replaced (only where the route is a `kind`, when given)."""

    def make(spec):
        route = route_fn(spec)
        return dataclasses.replace(route, **fields) if kind is None or isinstance(route, kind) else route

    return make


def _dsplit_backward(spec):
    """The default backward route, or attn_bwd_dsplit.py's (64 keys a program, the gradients split by
    columns) where the default is attn_bwd_keys.py at dv 128 (its pairs, GLUON_BWD_WIDE)."""
    from flashattn.backends.triton import routes as r
    from flashattn.backends.triton.host import block_d

    route = r.backward_route(spec)
    if isinstance(route, r.GluonBackward) and route.wide_keys and block_d(spec.headdim_v) == 128:
        return r.dsplit_backward_route(spec)
    return route


def _split_forward(spec):
    """The split-KV forward's route where it takes the call, else the default forward route."""
    from flashattn.backends.triton import decode_routes
    from flashattn.backends.triton import routes as r

    return decode_routes.SplitForward() if decode_routes.takes_split_forward(spec) else r.forward_route(spec)


def _unpacked_forward(spec):
    """The default forward route, with the Gluon forward's GQA group unpacked (a query tile per head:
    routes.gluon_forward_route(spec, packed=False)) where the default takes the Gluon forward."""
    from flashattn.backends.triton import routes as r

    route = r.forward_route(spec)
    return r.gluon_forward_route(spec, packed=False) if isinstance(route, r.GluonForward) else route


def _group_split(n: int) -> Callable:
    """The default backward route, its Gluon one with the GQA group split into gcd(n, group) parts."""
    import math

    from flashattn.backends.triton import routes as r

    def make(spec):
        route = r.backward_route(spec)
        if not isinstance(route, r.GluonBackward):
            return route
        return dataclasses.replace(route, group_split=math.gcd(n, spec.group))

    return make


def tiled_route(make: Callable, spec, tiles: dict, **fields):
    """make(spec) (a Gluon forward route maker) with its tiles' fields replaced by `tiles`, built under that
    tile override, so that what the route derives from its tiles (Q buffers, the deferred release, the
    half-diagonal step, registers) follows them as the route's own rules have it; then the route's other
    `fields` replaced (qk_ahead)."""
    from flashattn import config

    with config.use_tiles({"fwd_ws": dataclasses.replace(make(spec).tiles, **tiles)}):
        return dataclasses.replace(make(spec), **fields)


def _forward_keys(block_n: int, stages: int, block_m: int | None = None, **fields) -> Callable:
    """The default forward route, its Gluon one on block_n-key steps over `stages` K/V slots (tiled_route:
    two Q buffers where they fit, the half-diagonal step only on 128-key tiles), on block_m-row tiles where
    given; fields: as tiled_route's (qk_ahead, which needs 128 rows: two consumer warpgroups)."""
    from flashattn.backends.triton import routes as r

    tiles = dict(block_n=block_n, num_stages=stages, **({} if block_m is None else {"block_m": block_m}))

    def make(spec):
        route = r.forward_route(spec)
        if not isinstance(route, r.GluonForward):
            return route
        return tiled_route(r.forward_route, spec, tiles, **fields)

    return make


def _providers() -> list[Provider]:
    from flashattn.backends.triton import routes as r

    return [
        Provider("flashattn-triton", routed(r.triton_forward_route, r.triton_backward_route),
                 "this project's Triton kernels forward and backward (the routes every feature takes), "
                 "through the launchers (A/B timing)"),
        Provider("flashattn-gluon", routed(r.gluon_forward_route, r.gluon_backward_route),
                 "this project's Gluon kernels forward and backward on every call, head dims padded to their "
                 "tiles' widths (A/B timing: the default routes keep some calls on the Triton kernels, a "
                 "deterministic backward at padded head dims among them)"),
        Provider("flashattn-short-split", routed(_split_forward, r.backward_route),
                 "this project's default routes with forwards of at most 64 query rows (no more than keys) "
                 "on the split-KV decode kernel, a GQA group's rows packed (decode_routes.SplitForward; "
                 "A/B timing)"),
        Provider("flashattn-unpacked", routed(_unpacked_forward, r.backward_route),
                 "this project's default routes with the Gluon forward's GQA group unpacked, a query tile "
                 "per head (the default packs it where routes.gqa_pack takes it, FA3's pack_gqa; A/B "
                 "timing)"),
        Provider("flashattn-bwd-dsplit", routed(r.forward_route, _dsplit_backward),
                 "this project's default routes with the d_qk 129..192 / dv 65..128 backward on 64 keys a "
                 "program, the gradients split by columns (attn_bwd_dsplit.py), instead of 128 "
                 "(attn_bwd_keys.py; plain attention; A/B timing)"),
        Provider("flashattn-triton-bwd", _setup_triton_backward,
                 "this project's public call (every option) with the Triton backward (A/B timing)"),
        Provider("flashattn-ptr", routed(_replace(r.triton_forward_route, tma=False),
                                         _replace(r.triton_backward_route, tma=False)),
                 "this project's Triton kernels on pointer loads instead of TMA descriptors (A/B timing)"),
        Provider("flashattn-headmajor",
                 routed(_replace(r.forward_route, lpt_group=1),
                        _replace(r.backward_route, r.TritonBackward, kv_group=1, q_group=1)),
                 "this project's default routes with the launch order head by head instead of grouped "
                 "heaviest-first (A/B timing)"),
        *(Provider(f"flashattn-bwd-split{n}", routed(r.forward_route, _group_split(n)),
                   f"this project's default routes with the Gluon backward's GQA group split into {n} parts "
                   "per key tile, dK/dV added in float32 (A/B timing)") for n in (2, 4, 8)),
        Provider("flashattn-deterministic",
                 routed(r.forward_route, lambda spec: r.backward_route(
                     dataclasses.replace(spec, deterministic=True))),
                 "this project's default routes with the Gluon backward's fixed-order dQ variant, as "
                 "deterministic=True takes it (plain attention; A/B timing)"),
        *(Provider(f"flashattn-fwd-k{n}{'s3' if stages == 3 else ''}",
                   routed(_forward_keys(n, stages), r.backward_route),
                   f"this project's Gluon forward on {n}-key steps over {stages} K/V stages, the Q buffers "
                   "that fit (A/B timing)") for n, stages in ((32, 2), (64, 2), (64, 3), (128, 2))),
        *(Provider(f"flashattn-fwd-ahead-k{n}{'s3' if stages == 3 else ''}",
                   routed(_forward_keys(n, stages, 128, qk_ahead=True), r.backward_route),
                   f"this project's Gluon forward on 128-row tiles of {n}-key steps over {stages} K/V stages "
                   "with each next key tile's QK^T issued before this one's softmax (the route's qk_ahead; "
                   "A/B timing)") for n, stages in ((64, 2), (64, 3))),
        Provider("flashattn-ws-tiles", routed(_replace(r.forward_route, r.GluonForward, persistent=False),
                                              r.backward_route),
                 "this project's Gluon forward on one program per query tile instead of its persistent grid "
                 "(A/B timing)"),
    ]


PROVIDERS = [
    Provider("flashattn", _setup_public,
             "this project: flashattn.flash_attn_func (flash_attn_varlen_func on packed cases) with the "
             "case's window, softcap and sink, automatic backend choice"),
    *_providers(),
    Provider("torch-backend", _setup_torch_backend,
             "this project's chunked pure-PyTorch backend (flash_attn_func with the torch backend forced)"),
]
