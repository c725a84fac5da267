"""Sweep tile configs of each kernel on the GPU at the anchor shapes; print and save the best per head dim.

Usage (on the device): PYTHONPATH=src python scripts/tune_tiles.py --out $OUT/tune.json [--headdims 64,128]
Each candidate replaces its kernel's row of the tile table (flashattn.config.use_tiles), the others keep
their table entry, so the backward's two kernels are tuned one at a time (their times add). The Triton
kernels are what it tunes: the launchers run on their routes (flashattn.backends.triton.routes).
"""

import argparse
import functools
import json

import torch
from triton.testing import do_bench

from flashattn import config
from flashattn.backends.triton import routes
from flashattn.backends.triton.attention import attention_backward, attention_forward, spec_of

CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
            (128, 32, 4, 3)],
    "dkdv": [(64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 3),
             (32, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (128, 32, 4, 4), (64, 64, 4, 3),
           (128, 128, 8, 3)],
}
SHORT = {  # N <= 2K: few key tiles per program, so prologue/epilogue weigh; small tiles fit 2 programs/SM
    "fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
    "dkdv": [(64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3)],
    "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2)],
}
# Register caps (a fifth field, maxnreg) that let two 8-warp programs share an SM, and tiles that stop the
# shipped dK/dV programs spilling (ptxas -v on the sm_90a compile; docs/tuning-log.md).
# None is the table's entry, timed in the same run. Per head dim: a cap only makes sense for one d.
OCCUPANCY = {
    64: {"dkdv": [None, (32, 128, 8, 3, 128), (32, 128, 8, 3)], "dq": [(128, 128, 8, 3)]},
    128: {"fwd": [None, (128, 64, 8, 2, 128)], "dkdv": [None, (32, 128, 8, 3)]},
}
BIG_D = {  # d = 256: registers and shared memory bound the tiles
    "fwd": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 3)],
    "dkdv": [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2)],
    "dq": [(64, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
}


def _flops(b, h, n, d, causal):
    return 4 * b * h * n * n * d / (2 if causal else 1)


def _time(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--kernels", default="fwd,dkdv,dq")
    ap.add_argument("--table-only", action="store_true", help="time the shipped table's configs only")
    ap.add_argument("--short", action="store_true", help="the candidates for N <= 2K (SHORT)")
    ap.add_argument("--occupancy", action="store_true", help="the register-cap candidates (OCCUPANCY)")
    args = ap.parse_args()
    rows = []
    for d in (int(x) for x in args.headdims.split(",")):
        table = (OCCUPANCY.get(d, {}) if args.occupancy else BIG_D if d == 256 else SHORT if args.short
                 else CANDIDATES)
        cands = {name: c for name, c in table.items()
                 if name in args.kernels.split(",")}
        if args.table_only:
            cands = {"fwd": [None], "dkdv": [None]}  # dkdv with no override times the whole backward
        for n in (int(x) for x in args.seqlens.split(",")):
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for causal in (False, True):
                fl = _flops(b, h, n, d, causal)
                spec = spec_of(q, k, v, causal=causal, dout=do)
                kw = dict(softmax_scale=d**-0.5, causal=causal)
                out, lse = attention_forward(q, k, v, route=routes.triton_forward_route(spec), **kw)
                for kernel, configs in cands.items():
                    for cfg in configs:
                        # with 5 fields the last is maxnreg
                        tiles = {} if cfg is None else {kernel: config.parse_tiles(
                            f"{kernel}={','.join(map(str, cfg))}")[kernel]}
                        with config.use_tiles(tiles):
                            if kernel == "fwd":
                                fn = functools.partial(attention_forward, q, k, v,
                                                       route=routes.triton_forward_route(spec), **kw)
                                work = fl
                            else:
                                fn = functools.partial(attention_backward, do, q, k, v, out, lse,
                                                       route=routes.triton_backward_route(spec), **kw)
                                work = 2.5 * fl
                        try:
                            ms = _time(fn)
                            row = dict(kernel=kernel, d=d, n=n, causal=causal, cfg=cfg, ms=ms,
                                       tflops=work / ms / 1e9)
                        except Exception as e:  # noqa: BLE001 - OutOfResources, a compiler crash: a result
                            row = dict(kernel=kernel, d=d, n=n, causal=causal, cfg=cfg, error=str(e)[:200])
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            del q, k, v, do
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print("\nbest per (kernel, d, n, causal):")
    best = {}
    for r in rows:
        if "ms" in r:
            key = (r["kernel"], r["d"], r["n"], r["causal"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    for key, r in sorted(best.items()):
        print(key, r["cfg"], f"{r['tflops']:.0f} TFLOP/s ({'bwd total' if r['kernel'] != 'fwd' else 'fwd'})")


if __name__ == "__main__":
    main()
