"""Pieces every command module shares."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from types import FrameType

from batchline.store import default_url


def add_store_option(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    parser.add_argument("--store", default=None, metavar="URL", help=help_text or (
        f"sqlite:///path.db or postgresql://... (default: $BATCHLINE_STORE or {default_url()})"))


def store_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                  help_text: str) -> argparse.ArgumentParser:
    """A subcommand that reads or writes a store."""
    p = sub.add_parser(name, help=help_text, description=help_text)
    add_store_option(p)
    return p


def key_values(items: list[str], option: str) -> dict[str, str]:
    """Repeated KEY=VALUE options as a mapping; a malformed one is refused by its option's name."""
    from batchline.errors import BatchlineError

    pairs: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise BatchlineError(f"{option} {item!r} must be KEY=VALUE")
        pairs[key] = value
    return pairs


def on_stop_signals(act: Callable[[str], None]) -> None:
    """SIGTERM and SIGINT call `act` with the signal's name: a stop asked for, never a traceback."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        act(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
