"""The command line: a thin layer over the Python API.

Exit status 0 means the command did what it says; anything else comes with
one readable line on stderr that says why.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchline.errors import ERROR_PREFIX, BatchlineError


def build_parser() -> argparse.ArgumentParser:
    from batchline.cli import jobs

    parser = argparse.ArgumentParser(
        prog="batchline",
        description="Offline LLM jobs: every record answered exactly once, validated, published at once.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    jobs.register(sub)
    from batchline.cli import fleet

    fleet.register(sub)
    from batchline.cli import observe

    observe.register(sub)
    try:
        from batchline.cli import sizing
    except ImportError:
        pass
    else:
        sizing.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except BatchlineError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("batchline: interrupted", file=sys.stderr)
        return 130
