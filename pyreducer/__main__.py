"""Command line: `python -m pyreducer demo`."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyreducer")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train with torch DDP and pyreducer side by side")
    demo.add_argument("--nproc", type=int, default=2)
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--model", default="demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from pyreducer import demo as demo_module

        return demo_module.main(nproc=args.nproc, steps=args.steps, model=args.model)
    return 2


if __name__ == "__main__":
    sys.exit(main())
