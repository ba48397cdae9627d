"""Pieces every command module shares."""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from types import FrameType
from typing import TypeAlias

from batchline.store import default_url

# What `add_subparsers` returns (argparse's own type has no public name).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CommandTable:
    """A module's commands, each declared by a function of its own that adds its parser
    (used as a decorator), registered in the order they are declared: the order `--help`
    lists them."""

    def __init__(self) -> None:
        self._adders: list[Callable[[Subcommands], None]] = []

    def __call__(self, adder: Callable[[Subcommands], None]) -> Callable[[Subcommands], None]:
        self._adders.append(adder)
        return adder

    def register(self, sub: Subcommands) -> None:
        for adder in self._adders:
            adder(sub)


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


def duration(text: str) -> float:
    """A duration of 0 or more: seconds, or as a window is written (24h, 1h30m, 2d)."""
    from batchline.spec.deadline import parse_duration

    value = parse_duration(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration of 0 or more (seconds, or such as 24h, 1h30m)")
    return value
