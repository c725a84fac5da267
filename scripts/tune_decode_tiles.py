"""Sweep the split-KV decode kernel's tiles and split count at the decode suite's shapes; save every timing.
With --fp8 the caches are e4m3 and the 16-bit cache on its default route is timed beside them. With
--merge-ab only the default route runs, beside the same route whose merge takes the whole query block
(merge_rows = block_m), each through a DecodePlan: an A/B of the merge in one process.

Usage (on the device): PYTHONPATH=src python scripts/tune_decode_tiles.py --out $OUT/tune_decode.json
Each candidate tile config goes through flashattn.config.set_tiles ("decode=" or "decode_paged=", read when
a call's route is made), each split count through num_splits (0 = the launcher's heuristic). On a GPU every
call is captured in a CUDA graph and replayed, so the timings are GPU time (what a serving loop sees), not
Python's host cost. On the CPU (a smoke test of this script, under TRITON_INTERPRET=1) tiny shapes are timed
with perf_counter. The first tile of each list is the shipped default.
"""

import argparse
import functools
import itertools
import json
import statistics
import time

import torch

from flashattn import config, flash_attn_with_kvcache
from flashattn.fp8 import quantize

# 16-bit caches: 128-key tiles hold 64 KB of K/V a stage (one program an SM at 3 stages), 64-key tiles 32 KB
# (two or three an SM), so these pair with split factors that fill the residency (2, 3 at batch 1)
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 5), (64, 128, 8, 3)]
# paged caches get two more stages by default (the block-table read is pipelined too)
PAGED_TILES = [(64, 128, 4, 5), (64, 128, 4, 6), (64, 64, 4, 5), (64, 64, 4, 6), (64, 64, 4, 4)]
SPLIT_FACTORS = (0, 0.5, 2.0)  # 0: the heuristic; otherwise a multiple of the heuristic's count
# --fp8 (an e4m3 cache, per-head descales): half the bytes a tile, so more tiles or warps in flight
# (a fifth number caps the registers: 168 a thread lets 3 programs of 4 warps share an SM, 128 lets 4)
FP8_TILES = [(64, 128, 4, 3), (64, 128, 4, 3, 168), (64, 128, 4, 2, 128), (64, 64, 4, 3, 128),
             (64, 64, 4, 3), (64, 128, 8, 3)]
FP8_PAGED_TILES = [(64, 128, 4, 5), (64, 128, 4, 5, 168), (64, 128, 4, 4, 128), (64, 64, 4, 5, 128),
                   (64, 64, 4, 5)]


def _timer(device):
    if device.type == "cuda":
        from triton.testing import do_bench

        def gpu(fn):
            fn()  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return do_bench(graph.replay, warmup=25, rep=100, return_mode="median")

        return gpu

    def cpu(fn):
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)

    return cpu


def decode_inputs(b, kv_len, page, h, hk, d, device, dtype, fp8=False):
    """q, the caches (quantised to e4m3 per (sequence, KV head) with fp8), lengths, block table, and the
    descales' keyword arguments."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, 1, h, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, kv_len, hk, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    descales = {}
    if fp8:
        (k, kd), (v, vd) = quantize(k, "head"), quantize(v, "head")
        descales = dict(k_descale=kd, v_descale=vd)
    seqlens = torch.full((b,), kv_len, device=device, dtype=torch.int32)
    if page is None:
        return q, k, v, seqlens, None, descales
    pages = b * (kv_len // page)
    table = torch.randperm(pages, device=device).view(b, -1).to(torch.int32)
    k_pool, v_pool = k.new_empty(pages, page, hk, d), v.new_empty(pages, page, hk, d)
    # as bytes: indexing an e4m3 tensor needs kernels torch may not have
    for pool, x in ((k_pool, k), (v_pool, v)):
        pool.view(torch.uint8)[table.flatten().long()] = x.reshape(pages, page, hk, d).view(torch.uint8)
    return q, k_pool, v_pool, seqlens, table, descales


def heuristic_splits(b, h, hk, d, kv_len, paged, element_size, device):
    """The launcher's split count for this call under the tile override in force."""
    from flashattn.backends.triton import decode_routes
    from flashattn.backends.triton.merge import sm_count

    spec = decode_routes.DecodeSpec(b, h, hk, 1, d, element_size, paged, kv_len, sms=sm_count(device))
    return decode_routes.decode_route(spec).num_splits


def merge_ab(b, kv_len, page, h, hk, d, device, dtype, timer) -> dict:
    """The default route beside the same route with the merge taking the whole query block (merge_rows =
    block_m), each through a DecodePlan: (ms, ms)."""
    import dataclasses

    from flashattn import DecodePlan

    q, kc, vc, seqlens, table, _ = decode_inputs(b, kv_len, page, h, hk, d, device, dtype)
    times = {}
    for name in ("default", "whole block"):
        plan = DecodePlan(b, h, hk, d, page_size=page, max_seqlen_k=kv_len, dtype=dtype, device=device)
        if name == "whole block":
            plan.route = dataclasses.replace(plan.route, merge_rows=plan.route.block_m)
        times[name] = timer(functools.partial(plan.run, q, kc, vc, seqlens, table))
    return dict(batch=b, kv_len=kv_len, page_size=page, merge_rows_default_ms=times["default"],
                merge_rows_block_ms=times["whole block"], num_splits=plan.route.num_splits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tune_decode.json")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--seqlens", default="4096,16384,65536")
    ap.add_argument("--pages", default="none,64", help="page sizes; none = contiguous")
    ap.add_argument("--heads", default="32,8,128", help="h, h_k, d")
    ap.add_argument("--fp8", action="store_true", help="an e4m3 cache (per-head descales), its tile lists")
    ap.add_argument("--split-factors", default=",".join(map(str, SPLIT_FACTORS)))
    ap.add_argument("--merge-ab", action="store_true",
                    help="only the default route beside its merge over the whole query block (16-bit cache)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    h, hk, d = (int(x) for x in args.heads.split(","))
    timer = _timer(device)
    config.set_check_indices(False)  # a host sync; flash_attn has no such check
    results = []
    shapes = itertools.product([int(x) for x in args.batches.split(",")],
                               [int(x) for x in args.seqlens.split(",")],
                               [None if p == "none" else int(p) for p in args.pages.split(",")])
    for b, kv_len, page in shapes:
        if args.merge_ab:
            row = merge_ab(b, kv_len, page, h, hk, d, device, dtype, timer)
            print(f"b={b} kv={kv_len} page={page}: merge of the packed rows "
                  f"{row['merge_rows_default_ms']:.4f} ms, of the whole block "
                  f"{row['merge_rows_block_ms']:.4f} ms ({row['num_splits']} splits)", flush=True)
            results.append(row)
            continue
        q, kc, vc, seqlens, table, descales = decode_inputs(b, kv_len, page, h, hk, d, device, dtype,
                                                            args.fp8)
        kv_bytes = 2 * b * kv_len * hk * d * kc.element_size()
        key = "decode_paged" if page else "decode"
        rows = []
        tiles = (FP8_PAGED_TILES if page else FP8_TILES) if args.fp8 else (PAGED_TILES if page else TILES)
        for tile in tiles:
            config.set_tiles(f"{key}={','.join(map(str, tile))}")
            base = heuristic_splits(b, h, hk, d, kv_len, page is not None, kc.element_size(), device)
            for factor in (float(x) for x in args.split_factors.split(",")):
                splits = 0 if factor == 0 else max(1, round(base * factor))
                row = dict(batch=b, kv_len=kv_len, page_size=page, tile=list(tile), num_splits=splits,
                           heuristic_splits=base)
                call = functools.partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=seqlens,
                                         block_table=table, num_splits=splits, **descales)
                try:
                    ms = timer(call)
                    row.update(ms=ms, tbps=kv_bytes / (ms * 1e-3) / 1e12)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
        config.set_tiles(None)
        base16 = None
        if args.fp8:
            # the 16-bit cache on its default route, same shape and process: what the FP8 cache is measured by
            q, kc, vc, seqlens, table, _ = decode_inputs(b, kv_len, page, h, hk, d, device, dtype)
            base16 = timer(functools.partial(flash_attn_with_kvcache, q, kc, vc, cache_seqlens=seqlens,
                                             block_table=table))
            results.append(dict(batch=b, kv_len=kv_len, page_size=page, cache="16-bit", tile="default",
                                num_splits=0, ms=base16))
        timed = [r for r in rows if "ms" in r]
        default = next((r for r in timed if r["num_splits"] == 0 and r["tile"] == rows[0]["tile"]), None)
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        if best:
            ref = f"default {default['tbps']:.2f} TB/s; " if default else ""
            splits = best["num_splits"] or "heuristic"
            vs16 = f"; 16-bit cache {base16:.4f} ms, default {base16 / default['ms']:.2f}x, best " \
                f"{base16 / best['ms']:.2f}x its tokens/s" if base16 and default else ""
            print(f"b={b} kv={kv_len} page={page}: {ref}best {best['tbps']:.2f} TB/s, tile {best['tile']}, "
                  f"num_splits {splits} ({best['heuristic_splits']} by the heuristic){vs16}", flush=True)
        results += rows
    with open(args.out, "w") as f:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        doc = {"device": name, "h": h, "hk": hk, "d": d, "dtype": str(dtype), "fp8_cache": args.fp8,
               "rows": results}
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
