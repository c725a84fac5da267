"""The sm_90a SASS of one kernel a public call launches, read on a machine without a GPU.

scripts/sm90_compile_check.py's driver compiles every launch for the H200 instead of running it; this makes
one flash_attn_func (or flash_attn_varlen_func) call forward and backward on CPU tensors, takes the kernel
named, disassembles its cubin with Triton's nvdisasm and reports what the tuning log's readings need:

  - the instruction count and the opcode mix (spills show as STL / LDL);
  - each loop (branches back to an earlier label) with its instruction count, and the forward branches
    inside it with the instructions each skips: an if/else's two arms, so that what one iteration issues
    (one arm, not both) can be read off (the Gluon backward's key-step loop holds the masked and the
    unmasked path: at d = 64, 292 and 64 instructions of its 736).

    python scripts/sass_report.py [--kernel attn_bwd_ws_kernel] [--d 64] [--n 1024] [--heads 4]
        [--dv 128] [--heads-k 2] [--causal] [--sink] [--softcap 50] [--window 100,37] [--alibi] [--varlen]
        [--deterministic] [--pages 128] [--fp8] [--route qk_ahead=1] [--bwd-route dq_writer=1]
        [--sass OUT.sass] [--ptx OUT.ptx]

Counts are per thread (every thread of a warp issues the same stream), as nvdisasm lists them.
"""

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm90_compile_check as cc  # noqa: E402  (swaps Triton's driver: compile, never run)
import torch  # noqa: E402
import triton  # noqa: E402
from sass_listing import report  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def _fields(items) -> dict:
    """FIELD=INT options as {field: int}."""
    return {name: int(value) for name, value in (item.split("=") for item in items)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="attn_bwd_ws_kernel",
                   help="the kernel's name (default: the Gluon backward's)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--dv", type=int, default=None, help="V's head dim (default: d)")
    p.add_argument("--n", type=int, default=1024, help="sequence length (the varlen call: two sequences)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--heads-k", type=int, default=2)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--sink", action="store_true")
    p.add_argument("--softcap", type=float, default=0.0)
    p.add_argument("--window", type=lambda s: tuple(int(x) for x in s.split(",")), default=(-1, -1))
    p.add_argument("--alibi", action="store_true")
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--pages", type=int, default=0,
                   help="the varlen forward alone on page pools of this many keys (paged prefill, no grad)")
    p.add_argument("--fp8", action="store_true",
                   help="the FP8 forward alone (e4m3 q, k, v with per-head descales, V seqlen-contiguous; no "
                        "grad): the Gluon variant's kernel from 2K tokens on the default route")
    p.add_argument("--route", action="append", default=[], metavar="FIELD=INT",
                   help="a field of the call's Gluon forward route replaced (e.g. qk_ahead=1, block_n=64); "
                        "repeatable")
    p.add_argument("--bwd-route", action="append", default=[], metavar="FIELD=INT",
                   help="a field of the call's Gluon backward route replaced (e.g. dq_writer=1); repeatable")
    p.add_argument("--sass", help="also write the whole disassembly here")
    p.add_argument("--ptx", help="also write the kernel's PTX here")
    args = p.parse_args(argv)

    compiled = {}
    run = JITFunction.run

    def keep(self, *a, **k):
        kernel = run(self, *a, **k)
        compiled.setdefault(self.__name__, kernel)
        return kernel

    JITFunction.run = keep
    from flashattn import flash_attn_func, flash_attn_varlen_func, fp8
    from flashattn.backends.triton import routes
    from flashattn.bench.providers.ours import tiled_route

    def gluon_route(option, default, kind, spec):
        """default(spec), which --route / --bwd-route (option) replace fields of: a Gluon route."""
        route = default(spec)
        if not isinstance(route, kind):
            raise SystemExit(f"{option}: the call's route is {type(route).__name__}, not {kind.__name__}")
        return route

    def typed(route, fields):
        """FIELD=INT values as the route's own field types (bool, int)."""
        return {k: type(getattr(route, k))(v) for k, v in fields.items()}

    if args.route:
        fields = _fields(args.route)
        default = routes.forward_route

        def replaced(spec):
            route = gluon_route("--route", default, routes.GluonForward, spec)
            tiles = {k: fields[k] for k in ("block_m", "block_n", "num_stages") if k in fields}
            # rebuilt under the tile override (the bench's A/B providers' helper), so that what the route
            # derives from its tiles (Q buffers, registers, the half step) follows them
            rest = typed(route, {k: v for k, v in fields.items() if k not in tiles})
            return tiled_route(default, spec, tiles, **rest)

        routes.forward_route = replaced

    if args.bwd_route:
        bwd_fields = _fields(args.bwd_route)
        default_bwd = routes.backward_route

        def replaced_bwd(spec):
            route = gluon_route("--bwd-route", default_bwd, routes.GluonBackward, spec)
            return dataclasses.replace(route, **typed(route, bwd_fields))

        routes.backward_route = replaced_bwd

    h, hk, d, n = args.heads, args.heads_k, args.d, args.n
    dv = args.dv or d
    kw = dict(causal=args.causal, window_size=args.window, softcap=args.softcap,
              deterministic=args.deterministic)
    if args.sink:
        kw["learnable_sink"] = torch.zeros(h, requires_grad=True)
    if args.alibi:
        kw["alibi_slopes"] = torch.rand(h)
    if args.fp8:
        q8, qd = fp8.quantize(cc._t(2, n, h, d), "head")
        k8, kd = fp8.quantize(cc._t(2, n, hk, d), "head")
        v8, vd = fp8.quantize(cc._t(2, n, hk, dv), "head", seq_contiguous=True)
        kw.pop("deterministic")
        with torch.no_grad():
            flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
    elif args.pages:
        page = args.pages
        pages = -(-n // page)
        q = cc._t(n, h, d)
        k, v = cc._t(2 * pages, page, hk, d), cc._t(2 * pages, page, hk, dv)
        table = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)
        cu = torch.tensor([0, n // 3, n], dtype=torch.int32)
        kw.pop("deterministic")
        with torch.no_grad():
            flash_attn_varlen_func(q, k, v, cu, cu, n - n // 3, n - n // 3, block_table=table, **kw)
    elif args.varlen:
        q, k, v = (cc._t(n, heads, dim, grad=True) for heads, dim in ((h, d), (hk, d), (hk, dv)))
        cu = torch.tensor([0, n // 3, n], dtype=torch.int32)
        cc._fwd_bwd(flash_attn_varlen_func, q, k, v, cu, cu, n - n // 3, n - n // 3, **kw)
    else:
        q, k, v = (cc._t(2, n, heads, dim, grad=True) for heads, dim in ((h, d), (hk, d), (hk, dv)))
        cc._fwd_bwd(flash_attn_func, q, k, v, **kw)
    if args.kernel not in compiled:
        print(f"the call launched no {args.kernel}; it launched {sorted(compiled)}", file=sys.stderr)
        return 1
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    cubin = compiled[args.kernel].asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    if args.ptx:
        with open(args.ptx, "w") as f:
            f.write(compiled[args.kernel].asm["ptx"])
    print(f"{args.kernel} (sm_90a), {vars(args)}")
    print(report(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
