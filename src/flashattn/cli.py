"""`flashattn bench | io | check | demo`: the project's command line."""

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from flashattn import io_cli
    from flashattn.bench import cli as bench_cli

    bench_cli.add_arguments(sub.add_parser("bench", help="benchmark suites (providers side by side)"))
    io_cli.add_arguments(sub.add_parser("io", help="HBM-traffic model of each kernel"))

    sub.add_parser("check", help="check forward and gradients against the fp64 oracle on this machine")
    demo = sub.add_parser("demo", help="one attention call vs standard attention: error, time, memory")
    demo.add_argument("--seqlen", type=int, default=None)
    demo.add_argument("--no-causal", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from flashattn.bench import cli as bench_cli

        return bench_cli.run(args)
    if args.command == "io":
        from flashattn import io_cli

        return io_cli.run(args)
    from flashattn import demo

    if args.command == "check":
        return demo.check()
    return demo.demo(args.seqlen, causal=not args.no_causal)


if __name__ == "__main__":
    sys.exit(main())
