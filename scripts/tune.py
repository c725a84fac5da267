"""Sweep tile configs of each kernel on the GPU at the anchor shapes; print and save the best per head dim.

Usage (on the device): PYTHONPATH=src python scripts/tune.py --out $OUT/tune.json [--headdims 64,128]
Each candidate is set through FLASHATTN_CONFIG (read at call time by flashattn.ops.configs), the others keep
their table entry, so the backward's two kernels are tuned one at a time (their times add).
"""

import argparse
import functools
import json
import os

import torch
from triton.testing import do_bench

from flashattn.ops.attention import attention_backward, attention_forward

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
# Sixth session: register caps (a fifth field, maxnreg) that let two 8-warp programs share an SM, and tiles
# that stop the shipped dK/dV programs spilling (ptxas -v on the sm_90a compile: benchmarks/NOTES.md v14).
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
                out, lse = attention_forward(q, k, v, softmax_scale=d**-0.5, causal=causal)
                for kernel, configs in cands.items():
                    for cfg in configs:
                        if cfg is not None:  # with 5 fields the last is maxnreg (ops/configs.py)
                            os.environ["FLASHATTN_CONFIG"] = f"{kernel}={','.join(map(str, cfg))}"
                        kw = dict(softmax_scale=d**-0.5, causal=causal)
                        if kernel == "fwd":
                            fn = functools.partial(attention_forward, q, k, v, **kw)
                            work = fl
                        else:
                            fn = functools.partial(attention_backward, do, q, k, v, out, lse, **kw)
                            work = 2.5 * fl
                        try:
                            ms = _time(fn)
                            row = dict(kernel=kernel, d=d, n=n, causal=causal, cfg=cfg, ms=ms,
                                       tflops=work / ms / 1e9)
                        except Exception as e:  # noqa: BLE001 - OutOfResources, a compiler crash: a result, not the end
                            row = dict(kernel=kernel, d=d, n=n, causal=causal, cfg=cfg, error=str(e)[:200])
                        os.environ.pop("FLASHATTN_CONFIG", None)
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
