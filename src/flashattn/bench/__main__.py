"""`python -m flashattn.bench ...`: the bench CLI without going through flashattn.cli."""

import argparse
import sys

from .cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m flashattn.bench", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
