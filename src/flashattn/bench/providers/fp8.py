"""`flashattn-fp8*`: this project's FP8 (e4m3) inference forward, flashattn.flash_attn_func with q_descale,
k_descale and v_descale, on the case's inputs quantised by flashattn.fp8 (the output in the case's dtype):

- `flashattn-fp8`: per-head descales (quantize(x, "head")), V laid out with its seqlen dim contiguous
  (quantize(v, "head", seq_contiguous=True)): the timed call is the attention alone;
- `flashattn-fp8-rowv`: the same with V in the ordinary layout, read in place: the Triton kernel then makes
  the K-major P·V operand with byte permutes in registers, and the difference from flashattn-fp8 is their
  cost (against seqlen-contiguous loads, vectorised only at key lengths that are multiples of 16);
- `flashattn-fp8-gluon` / `flashattn-fp8-triton`: flashattn-fp8 on the warp-specialised Gluon forward's FP8
  variant / on the Triton forward's, through the launcher with that route named (the default route takes
  the Gluon one from 2K tokens, routes.takes_gluon_fp8_forward);
- `flashattn-fp8-k64`, `-k64s3`, `-k128s3`, `-m128`, `-m192`: flashattn-fp8 on the Gluon FP8 variant with
  other tiles (A/B timing of the tile table's rows for FP8): 64-key steps over 2 or 3 K/V stages, 128-key
  steps over 3, two or three consumer warpgroups of 64 rows (128- or 192-row tiles); the Q buffers that fit
  (routes.gluon_q_buffers); a config the Gluon forward cannot take at a head dim fails that row;
- `flashattn-fp8-m128k64`: 128-row tiles of 64-key steps over 2 stages; `flashattn-fp8-ahead-k64`,
  `-ahead-k64s3`: the same tiles (over 2 or 3 stages) with the route's qk_ahead (each next key tile's QK^T
  issued before this one's softmax: fwd_steps.ahead_steps);
- `flashattn-fp8+quant`: flashattn-fp8 with the three quantize calls (q, k, v from the case's dtype) inside
  the timed call, so its time says whether quantising costs more than FP8 saves;
- `flashattn-fp8+rot+quant`: the same with the rotation of incoherent processing (quantize's rotate_seed:
  q and k rotated inside the quantisation kernels' two passes).

Each is checked against the float64 oracle on the dequantised values of its own e4m3 inputs (check.Fp8Oracle):
quantisation is deterministic, so the copy the setup makes is the one the timed call makes. Inference only:
the calls run under torch.no_grad (entered once, outside the timed region); a backward mode is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..case import Case, torch_dtype
from .base import Prepared, Provider
from .ours import routes_info, tiled_route

# the seed of rotate_qk's random signs: fixed, so every run and every provider rotates alike
ROTATION_SEED = 0


class Fp8Inputs(NamedTuple):
    """q8 (b, sq, h, d), k8 (b, sk, h_k, d), v8 (b, sk, h_k, dv): float8_e4m3fn; descales float32, (1,) or
    (b, heads of their tensor)."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor


@dataclass(frozen=True)
class Recipe:
    """How a provider turns the case's q, k, v into e4m3 ones.

    granularity: flashattn.fp8.quantize's, "tensor" (one descale per tensor) or "head" (per (batch, head)).
    rotate: q and k quantised rotated (quantize's rotate_seed=ROTATION_SEED; QKᵀ is unchanged, outliers
        spread over the head dim).
    seq_contiguous_v: V quantised into the layout the FP8 P·V product reads without a copy.
    quantize_in_call: the quantisation (and rotation) is part of the timed call, not of the setup.
    """

    granularity: str = "head"
    rotate: bool = False
    seq_contiguous_v: bool = True
    quantize_in_call: bool = False

    def quantize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Fp8Inputs:
        """q, k, v (b, s, h, d) in a 16- or 32-bit dtype -> their e4m3 copies and descales."""
        from flashattn import fp8

        seed = ROTATION_SEED if self.rotate else None
        q8, qd = fp8.quantize(q, self.granularity, rotate_seed=seed, name="q")
        k8, kd = fp8.quantize(k, self.granularity, rotate_seed=seed, name="k")
        v8, vd = fp8.quantize(v, self.granularity, seq_contiguous=self.seq_contiguous_v, name="v")
        return Fp8Inputs(q8, k8, v8, qd, kd, vd)

    def info(self) -> dict:
        """The fields a result row gets: what was quantised how, and what the timed call includes."""
        return {"fp8_descale": self.granularity, "fp8_rotated": self.rotate,
                "fp8_v_layout": "seq-contiguous" if self.seq_contiguous_v else "row",
                "fp8_quantize_timed": self.quantize_in_call}


def fp8_options(case: Case, device: torch.device) -> dict:
    """The case's window, softcap and learnable sink as flash_attn_func's keywords (the sink without a
    gradient: there is no FP8 backward); none for a plain case."""
    if case.lengths is not None:
        raise ValueError("the FP8 providers take no packed sequences (the bench has no FP8 varlen case)")
    options: dict = {}
    if case.window != (-1, -1):
        options["window_size"] = case.window
    if case.softcap:
        options["softcap"] = case.softcap
    sink = case.learnable_sink(device)
    if sink is not None:
        options["learnable_sink"] = sink
    return options


def fp8_attention(x: Fp8Inputs, case: Case, out_dtype: torch.dtype, options: dict) -> torch.Tensor:
    """The public FP8 call on x: (b, sq, h, dv) in out_dtype."""
    import flashattn

    return flashattn.flash_attn_func(x.q8, x.k8, x.v8, causal=case.causal, q_descale=x.q_descale,
                                     k_descale=x.k_descale, v_descale=x.v_descale, out_dtype=out_dtype,
                                     **options)


def named_route(route_name: str, fields: dict | None = None, **tiles: int) -> Callable:
    """A call of the FP8 forward on x through the launcher with routes.<route_name>(spec) named; tiles: the
    route's tile fields replaced (block_m, block_n, num_stages) as a tile override would (the route built
    under it once per spec: everything it derives from the tiles follows them); fields: its other fields
    replaced after that (qk_ahead)."""
    tiled: dict = {}
    fields = fields or {}

    def call(x: Fp8Inputs, case: Case, out_dtype: torch.dtype, options: dict) -> torch.Tensor:
        from flashattn.backends.triton import attention, routes

        spec = attention.spec_of(x.q8, x.k8, x.v8, causal=case.causal, out_dtype=out_dtype, **options)
        make = getattr(routes, route_name)
        if not tiles:
            route = make(spec)
        elif (route := tiled.get(spec)) is None:
            route = tiled[spec] = tiled_route(make, spec, tiles, **fields)
        out, _ = attention.attention_forward_fp8(x.q8, x.k8, x.v8, x.q_descale, x.k_descale, x.v_descale,
                                                 out_dtype=out_dtype, softmax_scale=x.q8.shape[-1] ** -0.5,
                                                 causal=case.causal, route=route, **options)
        return out

    return call


Call = Callable[[Fp8Inputs, Case, torch.dtype, dict], torch.Tensor]


def prepare(recipe: Recipe, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            call: Call = fp8_attention, route_fwd: str | None = None) -> Prepared:
    """A provider of `recipe` on the case's q, k, v (b, s, h, d): `call(inputs, case, out_dtype, options)`
    is the attention timed (the public FP8 call by default), the output in the case's dtype; route_fwd: the
    kernel family it runs when that is not the default route's."""
    from ..check import Fp8Oracle

    out_dtype = torch_dtype(case.dtype)
    src = tuple(x.detach() for x in (q, k, v))
    options = fp8_options(case, q.device)
    x8 = recipe.quantize(*src)
    if recipe.quantize_in_call:
        def fwd() -> torch.Tensor:
            return call(recipe.quantize(*src), case, out_dtype, options)
    else:
        def fwd() -> torch.Tensor:
            return call(x8, case, out_dtype, options)

    routed = {key: options[key] for key in ("window_size", "softcap", "learnable_sink") if key in options}
    if route_fwd is None:
        route_fwd = routes_info(x8.q8, x8.k8, x8.v8, causal=case.causal, **routed)["route_fwd"]
    info = {"route_fwd": route_fwd, **recipe.info()}
    return Prepared(
        fwd=fwd,
        # the unquantised inputs, without gradients: a backward mode fails on them (there is no FP8 backward)
        leaves=src,  # type: ignore[arg-type]
        context=torch.no_grad,
        info=info,
        oracle=lambda budget: Fp8Oracle(case, *x8, out_dtype=out_dtype, budget_bytes=budget),
    )


RECIPES = {
    "flashattn-fp8": Recipe(),
    "flashattn-fp8-rowv": Recipe(seq_contiguous_v=False),
    "flashattn-fp8+quant": Recipe(quantize_in_call=True),
    "flashattn-fp8+rot+quant": Recipe(rotate=True, quantize_in_call=True),
}

_DESCRIPTIONS = {
    "flashattn-fp8": "this project's FP8 forward (e4m3, per-head descales, V seqlen-contiguous), inputs "
                     "quantised outside the timed call",
    "flashattn-fp8-rowv": "flashattn-fp8 with V in the ordinary layout (read in place, tiles transposed in "
                          "registers)",
    "flashattn-fp8+quant": "flashattn-fp8 with quantize() of q, k, v inside the timed call",
    "flashattn-fp8+rot+quant": "flashattn-fp8 with quantize(rotate_seed=) inside the timed call",
    "flashattn-fp8-gluon": "flashattn-fp8 on the Gluon forward's FP8 variant (its route named)",
    "flashattn-fp8-triton": "flashattn-fp8 on the Triton forward's FP8 variant (its route named)",
}
# A/B tiles of the Gluon FP8 variant: (name, the route's tile fields replaced, description)
TILE_VARIANTS = (
    ("flashattn-fp8-k64", dict(block_n=64, num_stages=2), "64-key steps over 2 K/V stages"),
    ("flashattn-fp8-k128s3", dict(block_n=128, num_stages=3), "128-key steps over 3 K/V stages"),
    ("flashattn-fp8-m128", dict(block_m=128), "128-row tiles (two consumer warpgroups)"),
    ("flashattn-fp8-m192", dict(block_m=192), "192-row tiles (three consumer warpgroups, serial steps)"),
    ("flashattn-fp8-k64s3", dict(block_n=64, num_stages=3), "64-key steps over 3 K/V stages"),
    ("flashattn-fp8-m128k64", dict(block_m=128, block_n=64, num_stages=2),
     "128-row tiles of 64-key steps over 2 K/V stages (the qk_ahead variants' tiles without it)"),
)
# A/B variants of the route's other fields: (name, tiles, fields, description)
ROUTE_VARIANTS = tuple(
    (f"flashattn-fp8-ahead-k64{'s3' if stages == 3 else ''}",
     dict(block_m=128, block_n=64, num_stages=stages), dict(qk_ahead=True),
     f"128-row tiles of 64-key steps over {stages} K/V stages, each next tile's QK^T issued before this "
     "one's softmax (qk_ahead)") for stages in (2, 3))


def _setup(recipe: Recipe) -> Callable[..., Prepared]:
    return lambda case, q, k, v: prepare(recipe, case, q, k, v)


def _gluon_variant(name: str, tiles: dict, fields: dict, text: str) -> Provider:
    """flashattn-fp8 on the Gluon forward's FP8 variant with its tiles and other route fields replaced."""
    return Provider(name, lambda case, q, k, v: prepare(
        Recipe(), case, q, k, v, call=named_route("gluon_forward_route", fields, **tiles),
        route_fwd="GluonForward"),
        f"flashattn-fp8 on the Gluon forward's FP8 variant with {text} (A/B timing)")


PROVIDERS = [Provider(name, _setup(recipe), _DESCRIPTIONS[name]) for name, recipe in RECIPES.items()] + [
    Provider("flashattn-fp8-gluon",
             lambda case, q, k, v: prepare(Recipe(), case, q, k, v, call=named_route("gluon_forward_route"),
                                           route_fwd="GluonForward"),
             _DESCRIPTIONS["flashattn-fp8-gluon"]),
    Provider("flashattn-fp8-triton",
             lambda case, q, k, v: prepare(Recipe(), case, q, k, v, call=named_route("triton_forward_route"),
                                           route_fwd="TritonForward"),
             _DESCRIPTIONS["flashattn-fp8-triton"]),
    *(_gluon_variant(name, tiles, {}, text) for name, tiles, text in TILE_VARIANTS),
    *(_gluon_variant(*variant) for variant in ROUTE_VARIANTS),
]
