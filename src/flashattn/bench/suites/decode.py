"""`decode`: one new query token against a long KV cache, the inference step flash-decoding is for.

bf16, 32 query heads, 8 KV heads, d = 128, q_len 1; batch 1 and `--batch` (default 16); kv_len 4K, 16K,
64K, 128K (`--seqlens`); the cache contiguous, or paged with pages of 64 and 256 keys scattered in a pool in
random order (as a serving cache holds them). Decode is bandwidth-bound, so the headline view is `tbps`: K/V
bytes read per second (2 · b · kv_len · h_k · d · 2 bytes / time; the anchors page's decode table).

Rows add `kv_len`, `page_size` (null when contiguous), `kv_bytes`, `tbps` and `kv_tokens_per_s` (b · kv_len
cache positions attended per second, the measure that compares caches of different dtypes). This project's
providers and FA4's read a paged cache; the others run the contiguous cases, which are the comparison for the
paged rows of the same shape. `fa4-kvcache` (-graph) is FlashAttention-4's call on the same caches, where its
wheels came along (on SM90 without split-KV, which FA4 has on SM100 only). `flashattn-kvcache` is the drop-in
call as a user makes it (eager: its host time is in the row), `flashattn-decode-plan` a DecodePlan's run,
`flashattn-kvcache-graph` the drop-in call replayed from a CUDA graph (GPU time without host overhead, which
bounds any eager decode step at short kv_len).

`flashattn-fp8cache` and `flashattn-fp8cache-graph` are the same two calls on an FP8 (e4m3) cache, quantised
from the case's keys and values per (sequence, KV head) with flashattn.fp8.quantize: half the bytes, so
their `kv_bytes` are their own, and `fp8cache_speedup` is their K/V tokens per second over the 16-bit
cache's (flashattn-kvcache, -graph) at the same shape. They are checked against the oracle on the
dequantised cache, the yardstick plain PyTorch on it (the case's oracle would count the quantisation error).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import providers as provider_registry
from ..case import Case, Grid, canonical_dtype, torch_dtype
from ..check import Oracle
from ..providers.base import Prepared, Provider, first_tensor, make_leaves
from ..results import KEY_FIELDS
from .base import MS, Suite, View, fmt_rate

PAGE_SIZES = (None, 64, 256)
OURS = "flashattn-kvcache"
OURS_PLAN = "flashattn-decode-plan"
OURS_GRAPH = "flashattn-kvcache-graph"
OURS_FP8 = "flashattn-fp8cache"
OURS_FP8_GRAPH = "flashattn-fp8cache-graph"
OURS_ALL = (OURS, OURS_PLAN, OURS_GRAPH, OURS_FP8, OURS_FP8_GRAPH)
FA4 = "fa4-kvcache"
FA4_GRAPH = "fa4-kvcache-graph"
# the providers that read a paged cache; the others run the contiguous rows only
PAGED = (*OURS_ALL, FA4, FA4_GRAPH)
# an fp8 provider -> the 16-bit cache's provider of the same call, which fp8cache_speedup compares with
FP8_BASELINES = {OURS_FP8: OURS, OURS_FP8_GRAPH: OURS_GRAPH}


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


def _setup_fa4(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    """FA4's decode call: flash_attn_varlen_func with the cache lengths as seqused_k and, paged, the block
    table as page_table. Its SM90 forward has no split-KV (num_splits must stay 1), so one CTA covers a
    KV head's whole cache; that is FA4 on Hopper as shipped."""
    # imported here: FA4 is there only where its wheels came along, and never on the CPU
    from flash_attn.cute.interface import flash_attn_varlen_func

    leaves, qb, kc, vc, table, seqlens = _caches(case, q, k, v)
    return Prepared(
        fwd=lambda: first_tensor(flash_attn_varlen_func(qb, kc, vc, seqused_k=seqlens, page_table=table,
                                                        max_seqlen_k=case.seqlen_k)),
        leaves=leaves,
    )


def _setup_fp8cache(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
    """The drop-in call on an e4m3 cache quantised per (sequence, KV head), paged when the case says so."""
    import flashattn
    from flashattn.fp8 import FP8, dequantize, quantize

    leaves = make_leaves(q, k, v, "bshd")
    qb = leaves[0].detach()
    k8, kd = quantize(k.detach(), "head")
    v8, vd = quantize(v.detach(), "head")
    page = case.extra.get("page_size")
    seqlens = torch.full((case.batch,), case.seqlen_k, dtype=torch.int32, device=q.device)
    if page is None:
        kc, vc, table = k8, v8, None
    else:
        # the page copy as bytes: indexing and zero-filling need no e4m3 kernels
        kc, table = paged_copy(k8.view(torch.uint8), page)
        vc, _ = paged_copy(v8.view(torch.uint8), page, table)
        kc, vc = kc.view(FP8), vc.view(FP8)
    # the values the call attends over, for its oracle: batch element 0 is all the check reads
    k_real, v_real = dequantize(k8[:1], kd[:1]), dequantize(v8[:1], vd[:1])

    def oracle(budget_bytes: int) -> Oracle:
        dout = torch.zeros_like(qb[:1])  # forward only: the check reads its shape
        check = Oracle(case, qb[:1], k_real, v_real, dout, grads=False, budget_bytes=budget_bytes)
        check.checked_on += "; against the dequantised e4m3 cache"
        return check

    nbytes = 2 * case.batch * case.seqlen_k * case.nheads_k * case.headdim * k8.element_size()
    return Prepared(
        fwd=lambda: flashattn.flash_attn_with_kvcache(qb, kc, vc, cache_seqlens=seqlens, block_table=table,
                                                      k_descale=kd, v_descale=vd),
        leaves=leaves, info={"kv_bytes": nbytes, "cache_dtype": str(FP8).removeprefix("torch.")},
        oracle=oracle,
    )


def _in_graph(setup: Callable[..., Prepared]) -> Callable[..., Prepared]:
    """A setup whose call is captured once in a CUDA graph and replayed, as servers run decode steps: the
    row shows GPU time alone, without the Python and launch overhead that bounds an eager step at short
    kv_len."""

    def graphed(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        eager = setup(case, q, k, v)
        if not q.is_cuda:
            raise RuntimeError("CUDA graphs need a CUDA device")
        eager.fwd()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = eager.fwd()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        # the graph reads the cache, lengths and block table by address: they must outlive the setup (freed,
        # the lengths' block was reused and a replay read keys past the cache: an illegal address at 16K)
        replay.inputs = eager
        return Prepared(fwd=replay, leaves=eager.leaves, info=eager.info, oracle=eager.oracle)

    return graphed


_setup_kvcache_graph = _in_graph(_setup_kvcache)
_setup_fp8cache_graph = _in_graph(_setup_fp8cache)
_setup_fa4_graph = _in_graph(_setup_fa4)


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
    Provider(
        OURS_FP8,
        _setup_fp8cache,
        f"{OURS} on an FP8 (e4m3) cache quantised per (sequence, KV head), eager; checked against the oracle "
        "on the dequantised cache",
    ),
    Provider(
        OURS_FP8_GRAPH,
        _setup_fp8cache_graph,
        f"{OURS_FP8} captured once in a CUDA graph and replayed",
    ),
    Provider(
        FA4,
        _setup_fa4,
        "FlashAttention-4: flash_attn.cute.interface.flash_attn_varlen_func with seqused_k (and page_table "
        "when paged), eager; no split-KV on SM90",
    ),
    Provider(
        FA4_GRAPH,
        _setup_fa4_graph,
        f"{FA4} captured once in a CUDA graph and replayed",
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
    if case.extra.get("page_size") is not None and provider not in PAGED:
        return "skipped: no paged KV cache in this provider; its contiguous row of the same shape compares"
    return None


SPEEDUP_FIELD = "fp8cache_speedup"
_SHAPE = ("batch", "nheads", "nheads_k", "headdim", "dtype", "kv_len", "page_size", "mode")


def annotate(rows: list[dict]) -> None:
    """On every timed row: tbps = K/V bytes read / time, kv_tokens_per_s = batch · kv_len / time; on the fp8
    providers' rows, fp8cache_speedup = the 16-bit cache's time / theirs (the ratio of their K/V tokens per
    second) at the same shape and mode."""
    timed = {}
    for r in rows:
        ms, nbytes = r.get("ms"), r.get("kv_bytes")
        ok = bool(ms) and not r.get("error")
        r["tbps"] = nbytes / (ms * 1e-3) / 1e12 if ok and nbytes else None
        tokens = (r.get("batch") or 0) * (r.get("kv_len") or 0)
        r["kv_tokens_per_s"] = tokens / (ms * 1e-3) if ok and tokens else None
        if ok:
            timed[(r.get("provider"), *(r.get(f) for f in _SHAPE))] = r
    for r in rows:
        base = FP8_BASELINES.get(r.get("provider"))
        if base is None:
            continue
        ref = timed.get((base, *(r.get(f) for f in _SHAPE)))
        r[SPEEDUP_FIELD] = ref["ms"] / r["ms"] if ref is not None and r["kv_tokens_per_s"] else None


@dataclass(frozen=True)
class DecodeSuite(Suite):
    """A Suite whose rows get a derived field once measured (`annotate`, run by the runner on every save)."""

    annotate: Callable[[list[dict]], None] = annotate


TBPS = View("tbps", "K/V read TB/s", fmt_rate)
KV_TOKENS = View("kv_tokens_per_s", "K/V tokens per second (millions)", lambda x: fmt_rate(x / 1e6),
                 plot_scale=1e6)
FP8_SPEEDUP = View(SPEEDUP_FIELD, "fp8 cache speedup: K/V tokens per second over the 16-bit cache's",
                   lambda x: f"{x:.2f}", plot=False)

SUITE = DecodeSuite(
    name="decode",
    description=(
        "bf16, q_len 1, h=32, h_k=8, d=128, b in {1, 16}, kv_len 4K..128K, contiguous and paged (64, 256): "
        "K/V bytes read per second, K/V tokens per second; the 16-bit cache beside an FP8 (e4m3) one"
    ),
    grid=_grid,
    providers=(OURS, OURS_PLAN, OURS_GRAPH, OURS_FP8, OURS_FP8_GRAPH, "sdpa-flash", "sdpa-cudnn", "flex",
               "sdpa-math", "flashattn"),
    modes=("fwd",),
    device="cuda",
    views=(TBPS, KV_TOKENS, FP8_SPEEDUP, MS),
    x_field="kv_len",
    panel_fields=("batch", "page_size"),
    baseline=OURS,
    skip=_skip,
    build_cases=build_cases,
    key_fields=(*(f for f in KEY_FIELDS if f != "seqlen_k"), "kv_len", "page_size"),
)
