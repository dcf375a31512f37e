"""``python -m tdist info``: what is installed and what each backend supports."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tdist", description="tdist command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="installed plugins, backend availability and the support table")
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._info import info_text

        print(info_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
