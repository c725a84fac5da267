"""`flashattn-baseline`: another revision of this project, vendored beside it, through its public call with
the case's window, packing, softcap and sink: the A/B of a change in one process. Two device runs of the
same tree differ by a few percent, about the size of the changes being judged, so a change is timed
against its parent in the same process or not at all.

`bash scripts/vendor_tree.sh REV flashattn_base` writes the copy to .baseline/src/flashattn_base (its
imports and torch.library namespace renamed); with .baseline/src on PYTHONPATH the provider imports it,
and elsewhere its rows carry the ImportError. Rows name the copy's routes as `flashattn`'s do, and its
`revision` (the REVISION file vendor_tree.sh writes)."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from ..case import Case
from .base import Prepared, Provider
from .ours import _setup_public

PACKAGE = "flashattn_base"


def _setup(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    prepared = _setup_public(case, q, k, v, PACKAGE)
    stamp = Path(importlib.import_module(PACKAGE).__file__).parent / "REVISION"
    prepared.info["revision"] = stamp.read_text().strip() if stamp.exists() else "unknown"
    return prepared


PROVIDERS = [
    Provider("flashattn-baseline", _setup,
             f"another revision of this project vendored as {PACKAGE} (scripts/vendor_tree.sh), through its "
             "public call with the case's options (A/B timing in one process)"),
]
