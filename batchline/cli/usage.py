"""The README's table of commands, rendered from the parser so the two cannot drift.

`python -m batchline.cli.usage` prints the block; `--write README.md` puts it
between the README's markers (`make readme`); `--check README.md` exits 1 when
the README's block differs from the parser's.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

BEGIN = "<!-- commands: rendered from the parser by `make readme`; a test fails when they differ -->"
END = "<!-- end of commands -->"
WIDTH = 100

# Every BATCHLINE_ variable the package reads (a test finds them in the source), and what it sets.
ENVIRONMENT = {
    "BATCHLINE_STORE": "the store when --store is not given (default sqlite:///batchline.db)",
    "BATCHLINE_STORE_WAIT": "worker --store-wait: seconds to wait for a store that cannot be reached yet",
    "BATCHLINE_PREEMPTION_NOTICE": "worker --preemption-notice: none, aws or gcp",
    "BATCHLINE_LOG_DIR": "where run puts its workers' logs without --log-dir (default: the temp folder)",
    "BATCHLINE_CACHE_DIR": "where packaged model weights are assembled (default ~/.cache/batchline)",
    "BATCHLINE_POD_NAME": "set by launch k8s manifests: the worker's pod, so its death can be proven",
    "BATCHLINE_POD_NAMESPACE": "set by launch k8s manifests: the pod's namespace",
    "BATCHLINE_POD_UID": "set by launch k8s manifests: the pod's uid",
    "BATCHLINE_SCHEDULED_JOB": "set by launch k8s --schedule manifests: the Job the CronJob made, whose name ends in the "
                         "scheduled minute, the run's --plan-key",
    "BATCHLINE_RAY_ACTOR": "set by launch ray: the worker's actor, so its death can be proven",
    "BATCHLINE_SYNTHETIC_SLOWDOWN": "the synthetic engine's time per record times this factor (drills)",
}


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """Each command that runs (the leaves: `launch ray`, not `launch`), with its help line."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _subcommands(sub)
                else:
                    yield sub, helps.get(name, "")


def usage(parser: argparse.ArgumentParser) -> str:
    """The command's usage as argparse writes it, without `-h`."""
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    formatter.add_usage(None, actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip("\n")


def render(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from batchline.cli import build_parser

        parser = build_parser()
    lines = [BEGIN, "", "```"]
    for sub, help_text in _subcommands(parser):
        lines.append(usage(sub))
        lines.extend(textwrap.wrap(help_text, WIDTH, initial_indent="    ", subsequent_indent="    "))
    lines += ["```", "", "Environment:", ""]
    lines += [f"- `{name}`: {what}" for name, what in ENVIRONMENT.items()]
    lines += ["", END]
    return "\n".join(lines)


def replaced(text: str, block: str, where: str) -> str:
    """`text` with its block between the markers replaced by `block`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{where}: no {BEGIN!r} ... {END!r} block to replace")
    return text[:start] + block + text[end + len(END):]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchline.cli.usage", description=__doc__)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="README", help="replace the README's block")
    action.add_argument("--check", type=Path, metavar="README", help="exit 1 when the README's block differs")
    args = parser.parse_args(argv)
    block = render()
    path: Path | None = args.write or args.check
    if path is None:
        print(block)
        return 0
    text = path.read_text(encoding="utf-8")
    updated = replaced(text, block, str(path))
    if args.check:
        if updated != text:
            print(f"{path}: the command table differs from the parser; run `make readme`", file=sys.stderr)
            return 1
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
        print(f"{path}: command table rendered from the parser", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
