"""`flashattn bench`: the one tool behind every performance claim of the project.

flashattn.cli calls `add_arguments(subparser)` and `run(args)`; `python -m flashattn.bench` works on its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .case import MODES, canonical_dtype


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(
            int(x.lower().removesuffix("k")) * (1024 if x.lower().endswith("k") else 1)
            for x in text.split(",")
            if x
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1024,2k; got {text!r}"
        ) from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import providers, suites

    what = parser.add_argument_group("what to run")
    what.add_argument(
        "--suite", choices=sorted(suites.all_suites()), help="default: train on a GPU, cpu without one"
    )
    what.add_argument(
        "--providers",
        type=_names,
        metavar="A,B,...",
        help=f"default: the suite's; known: {', '.join(sorted(providers.all_providers()))}",
    )
    what.add_argument(
        "--add-providers",
        type=_names,
        metavar="A,B,...",
        help="providers timed besides --providers or the suite's (e.g. fa4 where its wheels are)",
    )
    what.add_argument("--modes", type=_names, metavar="fwd,bwd,fwd+bwd", help="default: the suite's")
    what.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    what.add_argument("--quick", action="store_true", help="a reduced grid and fewer timing repeats")
    what.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")

    shape = parser.add_argument_group("shape overrides (replace the suite's grid)")
    shape.add_argument("--dtype", type=canonical_dtype, help="bf16, fp16 or fp32")
    shape.add_argument("--seqlens", type=_ints, metavar="N,...", help="e.g. 1024,2k,4096")
    shape.add_argument("--headdims", type=_ints, metavar="D,...", help="e.g. 64,128")
    batch = shape.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, help="fixed batch size")
    batch.add_argument("--tokens", type=int, help="batch = tokens // seqlen (at least 1)")
    heads = shape.add_mutually_exclusive_group()
    heads.add_argument("--nheads", type=int, help="fixed number of query heads")
    heads.add_argument("--hidden", type=int, help="nheads = hidden // headdim")
    shape.add_argument("--nheads-k", type=int, help="key/value heads (GQA); default: nheads")
    shape.add_argument("--causal", choices=("both", "yes", "no"), help="default: the suite's")

    out = parser.add_argument_group("output")
    out.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="results folder (default: benchmarks/results/<gpu>-<YYYY-MM-DD>/)",
    )
    out.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of an existing <suite>.json in --out that this run does not measure again",
    )
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument(
        "--ncu",
        nargs="?",
        const="",
        metavar="PATH",
        help="after timing, profile one call per measured row under Nsight Compute (ncu on PATH, or the path "
        "given) and add its DRAM bytes (a process per row: narrow the run first)",
    )
    out.add_argument("--quiet", action="store_true", help="no progress lines")

    other = parser.add_argument_group("without running anything")
    other.add_argument("--list", action="store_true", help="list suites and providers")
    other.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="re-render markdown and plots from results files beside each; with --out, combine them into one",
    )
    other.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("A.json", "B.json"),
        help="time per shape of two runs and the speedup of B over A",
    )


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list()
    try:
        if args.report:
            return _report(args)
        if args.compare:
            return _compare(args)
        return _bench(args)
    except (KeyError, ValueError) as exc:
        print(f"flashattn bench: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2


def _list() -> int:
    from . import providers, suites

    print("suites:")
    for s in suites.all_suites().values():
        print(f"  {s.name:<10} {s.description}\n  {'':<10} providers: {', '.join(s.providers)}")
    print("providers:")
    for p in providers.all_providers().values():
        print(f"  {p.name:<15} {p.description}")
    return 0


def _report(args) -> int:
    from . import report, results, suites

    docs = [results.load(p) for p in args.report]
    if args.out and len(docs) > 1:
        # parts of one sweep run separately (each GPU call has a time limit) become one results file
        names = {d["meta"].get("suite") for d in docs}
        if len(names) != 1:
            raise ValueError(
                f"--report with --out combines runs of one suite; got suites {sorted(map(str, names))}"
            )
        key_fields = suites.lookup(str(next(iter(names)))).key_fields
        rows: list[dict] = []
        for d in docs:
            rows = results.merge_rows(rows, d["rows"], key_fields)
        meta = dict(docs[-1]["meta"], parts=[d["meta"] for d in docs])
        docs, outs = [{"meta": meta, "rows": rows}], [args.out]
        results.write(args.out / f"{meta.get('suite', 'bench')}.json", docs[0])
    else:
        outs = [args.out or p.parent for p in args.report]
    for doc, out in zip(docs, outs, strict=True):
        written = report.render(doc, out, plots=not args.no_plots)
        report.print_tables(doc)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _compare(args) -> int:
    from . import report, results

    a, b = (results.load(p) for p in args.compare)
    text = report.compare_markdown(a, b, args.compare[0].stem, args.compare[1].stem)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.md").write_text(text)
    return 0


def _device(name: str):
    """--device as a torch.device that exists here; a ValueError (one line from `run`) otherwise."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device; expected cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            cuda_build = torch.version.cuda
            build = "a CPU-only build" if cuda_build is None else f"built for CUDA {cuda_build}"
            raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__} is "
                             f"{build}); pass --device cpu, or run on a machine with a GPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: the benchmarks run on cuda or cpu")
    return device


def _bench(args) -> int:
    import torch

    from . import check, env, ncu, providers, report, results, suites
    from .runner import RunConfig, Runner
    from .timing import TimerConfig

    cuda = torch.cuda.is_available()
    suite = suites.get(args.suite or ("train" if cuda else "cpu"))
    if args.device:
        device = _device(args.device)
    elif suite.device == "cpu" or not cuda:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    if suite.device == "cuda" and device.type != "cuda" and not args.device:
        raise ValueError(
            f"suite {suite.name!r} is sized for a GPU and none is available; run --suite cpu, "
            "or pass --device cpu with small --seqlens to try it anyway"
        )
    if suite.run is not None:
        return suite.run(args, device)
    causal = {"both": (False, True), "yes": (True,), "no": (False,), None: None}[args.causal]
    grid = suite.grid(args.quick).override(
        dtype=args.dtype,
        seqlens=args.seqlens,
        headdims=args.headdims,
        causal=causal,
        batch=args.batch,
        tokens=args.tokens,
        nheads=args.nheads,
        hidden=args.hidden,
        nheads_k=args.nheads_k,
    )
    names = list(args.providers or suite.providers)
    names += [n for n in args.add_providers or () if n not in names]
    known = providers.all_providers()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown provider(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    modes = tuple(args.modes or suite.modes)
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"unknown mode(s) {', '.join(bad)}; expected some of {', '.join(MODES)}")

    timer = TimerConfig.quick() if args.quick else TimerConfig()
    out_dir = args.out or env.default_out_dir(device)
    out_json = out_dir / f"{suite.name}.json"
    earlier = results.load(out_json) if args.merge and out_json.exists() else None
    meta = env.collect_meta(device)
    meta.update(
        suite=suite.name,
        providers=names,
        modes=list(modes),
        timer=timer.describe(device),
        # a suite whose providers are checked against more than the dense oracle says so (fp8)
        reference=getattr(suite, "reference", None) or check.REFERENCE,
        quick=args.quick,
        seed=args.seed,
    )
    if earlier is not None:
        old = earlier["meta"]
        meta["earlier_runs"] = [
            *old.get("earlier_runs", []),
            {k: old.get(k) for k in ("command", "datetime", "git_sha", "gpu")},
        ]
    cfg = RunConfig(
        suite=suite,
        cases=suite.build_cases(grid),
        providers=names,
        modes=modes,
        device=device,
        timer=timer,
        meta=meta,
        out_json=out_json,
        keep_rows=earlier["rows"] if earlier else [],
        seed=args.seed,
        quiet=args.quiet,
    )
    doc = Runner(cfg).run()
    if args.ncu is not None:
        ncu_path = ncu.find_ncu(args.ncu or None)
        if ncu_path is None:
            raise ValueError("--ncu: Nsight Compute (ncu) is not on PATH; pass its path, --ncu /path/to/ncu")
        doc["meta"]["ncu"] = " ".join((ncu_path, *ncu.NCU_FLAGS))
        ncu.annotate_rows(doc["rows"], ncu_path, seed=args.seed, progress=lambda m: args.quiet or print(m))
    results.write(out_json, doc)
    written = [out_json, *report.render(doc, out_dir, plots=not args.no_plots)]
    report.print_tables(doc)
    wrong = sorted({r["provider"] for r in doc["rows"] if (r.get("error") or "").startswith("wrong result")})
    if wrong:
        print(f"WRONG results (not timed) from: {', '.join(wrong)}; see the error fields")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
