"""The ``sbpflow`` command: demo | launch | plan | trace | bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbpflow", description="sbpflow: distribution as a property of tensors")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo on virtual devices")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
