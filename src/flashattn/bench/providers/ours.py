"""`flashattn` (this project, through its public API); for A/B timing the same with one switch set:
`flashattn-ptr` (TMA descriptors off: the pointer-load path), `flashattn-headmajor` (the former launch order),
`flashattn-triton` (the warp-specialised Gluon forward off), `flashattn-triton-bwd` (the Gluon backward off),
`flashattn-ws-tiles` (the Gluon forward on one program per query tile instead of its persistent grid);
and `torch-backend` (its pure-PyTorch backend)."""

from __future__ import annotations

import torch

from ..case import Case
from .base import Prepared, Provider, env_variant, first_tensor, make_leaves


def _setup_public(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    leaves = make_leaves(q, k, v, "bshd")
    qb, kb, vb = leaves
    return Prepared(
        fwd=lambda: first_tensor(flashattn.flash_attn_func(qb, kb, vb, causal=case.causal)), leaves=leaves
    )


def _setup_torch_backend(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    # fail here, with the import's own message, if the backend is missing, rather than timing another backend
    import flashattn.torch_backend  # noqa: F401

    return env_variant(_setup_public, "FLASHATTN_BACKEND", "torch")(case, q, k, v)


PROVIDERS = [
    Provider("flashattn", _setup_public, "this project: flashattn.flash_attn_func, automatic backend choice"),
    Provider("flashattn-ptr", env_variant(_setup_public, "FLASHATTN_TMA", "0"),
             "this project with FLASHATTN_TMA=0: pointer loads instead of TMA descriptors (A/B timing)"),
    Provider("flashattn-headmajor", env_variant(_setup_public, "FLASHATTN_SCHEDULE", "head-major"),
             "this project with FLASHATTN_SCHEDULE=head-major: programs head by head, the launch order "
             "before the grouped heaviest-first one (A/B timing)"),
    Provider("flashattn-triton", env_variant(_setup_public, "FLASHATTN_WS", "0"),
             "this project with FLASHATTN_WS=0: the Triton forward instead of the warp-specialised Gluon one "
             "(A/B timing)"),
    Provider("flashattn-triton-bwd", env_variant(_setup_public, "FLASHATTN_WS_BWD", "0"),
             "this project with FLASHATTN_WS_BWD=0: the Triton backward (dK/dV and dQ programs) instead of "
             "the warp-specialised Gluon one (A/B timing)"),
    Provider("flashattn-ws-tiles", env_variant(_setup_public, "FLASHATTN_WS_GRID", "tiles"),
             "this project with FLASHATTN_WS_GRID=tiles: the Gluon forward on one program per query tile "
             "instead of its persistent grid (A/B timing)"),
    Provider(
        "torch-backend",
        _setup_torch_backend,
        "this project's chunked pure-PyTorch backend (flash_attn_func under FLASHATTN_BACKEND=torch)",
    ),
]
