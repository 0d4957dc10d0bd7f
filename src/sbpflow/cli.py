"""The ``sbpflow`` command: demo | launch | plan | trace | bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sbpflow", description="sbpflow: distribution as a property of tensors")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo.train_gpt import run_from_args

        run_from_args(args)
        return 0
    return 0


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .demo.train_gpt import DESCRIPTION, add_arguments

    add_arguments(sub.add_parser("demo", help="train a small GPT on virtual CPU devices (data x tensor x pipeline)",
                                 description=DESCRIPTION))


if __name__ == "__main__":
    sys.exit(main())
