"""`decode`: one new query token against a long KV cache, the inference step flash-decoding is for.

bf16, 32 query heads, 8 KV heads, d = 128, q_len 1; batch 1 and `--batch` (default 16); kv_len 4K, 16K,
64K, 128K (`--seqlens`); the cache contiguous, or paged with pages of 64 and 256 keys scattered in a pool in
random order (as a serving cache holds them). Decode is bandwidth-bound, so the headline view is `tbps`: K/V
bytes read per second (2 · b · kv_len · h_k · d · 2 bytes / time; the anchors page's decode table).

Rows add `kv_len`, `page_size` (null when contiguous), `kv_bytes` and `tbps`. Only this project's providers
read a paged cache; the others run the contiguous cases, which are the comparison for the paged rows of the
same shape. `flashattn-kvcache` is the drop-in call as a user makes it (eager: its host time is in the row),
`flashattn-decode-plan` a DecodePlan's run, `flashattn-kvcache-graph` the drop-in call replayed from a CUDA
graph (GPU time without host overhead, which bounds any eager decode step at short kv_len).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import providers as provider_registry
from ..case import Case, Grid, canonical_dtype, torch_dtype
from ..providers.base import Prepared, Provider, make_leaves
from ..results import KEY_FIELDS
from .base import MS, Suite, View, fmt_rate

PAGE_SIZES = (None, 64, 256)
OURS = "flashattn-kvcache"
OURS_PLAN = "flashattn-decode-plan"
OURS_GRAPH = "flashattn-kvcache-graph"


def paged_copy(k: torch.Tensor, page: int, table: torch.Tensor | None = None):
    """(pool, block_table): k (b, n, h_k, d) cut into pages of `page` keys at random places of a pool (or at
    the places `table` gives: the V pool of the same K pool)."""
    b, n, hk, d = k.shape
    pages = -(-n // page)
    if table is None:
        table = torch.randperm(b * pages, device=k.device).view(b, pages).to(torch.int32)
    pool = k.new_zeros(b * pages, page, hk, d)
    padded = k if n == pages * page else torch.cat((k, k.new_zeros(b, pages * page - n, hk, d)), dim=1)
    pool[table.flatten().long()] = padded.reshape(b * pages, page, hk, d)
    return pool, table


def _caches(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(leaves, q, k_cache, v_cache, block_table, cache_seqlens) of a case: paged when the case says so."""
    leaves = make_leaves(q, k, v, "bshd")
    page = case.extra.get("page_size")
    seqlens = torch.full((case.batch,), case.seqlen_k, dtype=torch.int32, device=q.device)
    if page is None:
        kc, vc, table = k.detach(), v.detach(), None
    else:
        kc, table = paged_copy(k.detach(), page)
        vc, _ = paged_copy(v.detach(), page, table)
    return leaves, leaves[0].detach(), kc, vc, table, seqlens


def _setup_kvcache(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    leaves, qb, kc, vc, table, seqlens = _caches(case, q, k, v)
    return Prepared(
        fwd=lambda: flashattn.flash_attn_with_kvcache(qb, kc, vc, cache_seqlens=seqlens, block_table=table),
        leaves=leaves,
    )


def _setup_plan(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    import flashattn

    leaves, qb, kc, vc, table, seqlens = _caches(case, q, k, v)
    plan = flashattn.DecodePlan(case.batch, case.nheads, case.nheads_k, case.headdim,
                                page_size=case.extra.get("page_size"), max_seqlen_k=case.seqlen_k,
                                dtype=qb.dtype, device=qb.device)
    return Prepared(fwd=lambda: plan.run(qb, kc, vc, seqlens, table), leaves=leaves)


def _setup_kvcache_graph(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    # the same call captured in a CUDA graph, as servers run decode steps: the row shows GPU time alone,
    # without the Python and launch overhead that bounds an eager step at short kv_len
    eager = _setup_kvcache(case, q, k, v)
    if not q.is_cuda:
        raise RuntimeError("CUDA graphs need a CUDA device")
    eager.fwd()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = eager.fwd()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    # the graph reads the cache, lengths and block table by address: they must outlive the setup (freed, the
    # lengths' block was reused and a replay read keys past the cache: an illegal address at kv_len 16K)
    replay.inputs = eager
    return Prepared(fwd=replay, leaves=eager.leaves)


for _provider in (
    Provider(
        OURS,
        _setup_kvcache,
        "this project: flashattn.flash_attn_with_kvcache, eager (one launch: split-KV decode and the merge "
        "of splits; paged when the case says so)",
    ),
    Provider(
        OURS_PLAN,
        _setup_plan,
        "this project: a flashattn.DecodePlan planned for the case, its run() timed eagerly",
    ),
    Provider(
        OURS_GRAPH,
        _setup_kvcache_graph,
        f"{OURS} captured once in a CUDA graph and replayed: GPU time without host overhead",
    ),
):
    provider_registry.register(_provider, replace=True)


def _grid(quick: bool) -> Grid:
    return Grid(
        dtype="bf16",
        seqlens=(4096, 65536) if quick else (4096, 16384, 65536, 131072),
        headdims=(128,),
        causal=(False,),
        batch=16,
        nheads=32,
        nheads_k=8,
    )


def build_cases(grid: Grid) -> list[Case]:
    """batch 1 and grid.batch × kv_len × (contiguous, page 64, page 256); q_len 1, never causal (a single
    query row sees the whole cache either way)."""
    dtype = canonical_dtype(grid.dtype)
    elem = torch.tensor([], dtype=torch_dtype(dtype)).element_size()
    batches = sorted({1, grid.batch or 1})
    cases = []
    for d in grid.headdims:
        h = grid.nheads if grid.nheads is not None else max(1, grid.hidden // d)
        hk = grid.nheads_k if grid.nheads_k is not None else h
        for b in batches:
            for n in grid.seqlens:
                for page in PAGE_SIZES:
                    extra = {"kv_len": n, "page_size": page, "kv_bytes": 2 * b * n * hk * d * elem}
                    cases.append(Case(b, h, hk, 1, n, d, False, dtype, extra))
    return cases


def _skip(case: Case, provider: str) -> str | None:
    if case.extra.get("page_size") is not None and provider not in (OURS, OURS_PLAN, OURS_GRAPH):
        return "skipped: no paged KV cache in this provider; its contiguous row of the same shape compares"
    return None


def annotate(rows: list[dict]) -> None:
    """tbps = K/V bytes read / time, on every timed row."""
    for r in rows:
        ms, nbytes = r.get("ms"), r.get("kv_bytes")
        r["tbps"] = nbytes / (ms * 1e-3) / 1e12 if ms and nbytes and not r.get("error") else None


@dataclass(frozen=True)
class DecodeSuite(Suite):
    """A Suite whose rows get a derived field once measured (`annotate`, run by the runner on every save)."""

    annotate: Callable[[list[dict]], None] = annotate


TBPS = View("tbps", "K/V read TB/s", fmt_rate)

SUITE = DecodeSuite(
    name="decode",
    description=(
        "bf16, q_len 1, h=32, h_k=8, d=128, b in {1, 16}, kv_len 4K..128K, contiguous and paged (64, 256): "
        "K/V bytes read per second"
    ),
    grid=_grid,
    providers=(OURS, OURS_PLAN, OURS_GRAPH, "sdpa-flash", "sdpa-cudnn", "flex", "sdpa-math", "flashattn"),
    modes=("fwd",),
    device="cuda",
    views=(TBPS, MS),
    x_field="kv_len",
    panel_fields=("batch", "page_size"),
    baseline=OURS,
    skip=_skip,
    build_cases=build_cases,
    key_fields=(*(f for f in KEY_FIELDS if f != "seqlen_k"), "kv_len", "page_size"),
)
