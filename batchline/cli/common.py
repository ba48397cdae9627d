"""Pieces every command module shares."""

from __future__ import annotations

import argparse

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
