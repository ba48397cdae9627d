"""The command line: a thin layer over the Python API.

Exit status 0 means the command did what it says; anything else comes with
one readable line on stderr that says why.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Sequence

from batchline.errors import ERROR_PREFIX, BatchlineError
from batchline.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from batchline.cli import jobs

    parser = argparse.ArgumentParser(
        prog="batchline",
        description="Offline LLM jobs: every record answered exactly once, validated, published at once.",
    )
    parser.add_argument("--version", action="version", version=f"batchline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    jobs.register(sub)
    from batchline.cli import fleet

    fleet.register(sub)
    from batchline.cli import observe

    observe.register(sub)
    from batchline.cli import lineage

    lineage.register(sub)
    try:
        from batchline.cli import sizing
    except ImportError:
        pass
    else:
        sizing.register(sub)
    return parser


# What the shell reports for a Unix tool that SIGPIPE ended (128 + 13): the reader of its
# output left early (`| head`), which is the reader's choice, not a failure to report.
EXIT_READER_LEFT = 141


def _reader_left(stream: object) -> bool:
    """Whether `stream` is a pipe whose reading end is closed: poll reports an error on
    it. A broken pipe anywhere else (an engine child, a socket) is a real failure."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
        poller = select.poll()
        poller.register(fd, 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        code: int = args.func(args)
        # Flushed here rather than at exit, so that a reader that left is seen below
        # instead of as a traceback while the interpreter shuts down.
        sys.stdout.flush()
        return code
    except BrokenPipeError as exc:
        if not _reader_left(sys.stdout):
            print(f"batchline: error: {exc}", file=sys.stderr)
            return 1
        # What is still buffered goes nowhere, quietly, when the interpreter exits.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_READER_LEFT
    except BatchlineError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("batchline: interrupted", file=sys.stderr)
        return 130
