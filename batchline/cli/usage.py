"""The documentation's generated parts: the command line's, rendered from the parser, and
the others batchline.ops.docs renders from the code, so that the docs cannot drift from it.

`python -m batchline.cli.usage` prints the commands; `--write docs` renders every part of
every page under docs/ (`make docs`); `--check docs` exits 1 when a page's part differs
from the code, or when a part is on no page.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from batchline.ops import docs

WIDTH = 100
ROOT = Path(__file__).resolve().parents[2]

# Every BATCHLINE_ variable the package reads (a test finds them in the source), and what it sets.
ENVIRONMENT = {
    "BATCHLINE_STORE": "the store when --store is not given (default sqlite:///batchline.db)",
    "BATCHLINE_STORE_WAIT": "worker --store-wait: seconds to wait for a store that cannot be reached yet",
    "BATCHLINE_PREEMPTION_NOTICE": "worker --preemption-notice: none, aws or gcp",
    "BATCHLINE_LOG_DIR": "where run puts its workers' logs without --log-dir (default: the temp folder)",
    "BATCHLINE_CACHE_DIR": "where weights are kept: fetched from object storage, packaged ones assembled (default "
                           "~/.cache/batchline; launch k8s manifests set it to the weights cache's volume)",
    "BATCHLINE_POD_NAME": "set by launch k8s manifests: the worker's pod, so its death can be proven",
    "BATCHLINE_POD_NAMESPACE": "set by launch k8s manifests: the pod's namespace",
    "BATCHLINE_POD_UID": "set by launch k8s manifests: the pod's uid",
    "BATCHLINE_SCHEDULED_JOB": "set by launch k8s --schedule manifests: the Job the CronJob made, whose name ends in the "
                         "scheduled minute, the run's --plan-key",
    "BATCHLINE_RAY_ACTOR": "set by launch ray: the worker's actor, so its death can be proven",
    "BATCHLINE_REGION": "the region a worker runs in, where --region is not given (an image's way to say it): it "
                        "reads that region's replica of the input and claims its shards first",
    "BATCHLINE_HEARTBEAT_SECONDS": "how often a worker heartbeats (default 5; 0.1 to 60): the capacity a pacer counts, "
                                   "and how often a paid worker holds max_cost",
    "BATCHLINE_RAY_NODE": "set by launch ray: the node the worker's actor runs on, in its process identity",
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


def commands(parser: argparse.ArgumentParser | None = None) -> str:
    """Every command's usage and help line, as the parser has them."""
    if parser is None:
        from batchline.cli import build_parser

        parser = build_parser()
    lines = ["```"]
    for sub, help_text in _subcommands(parser):
        lines.append(usage(sub))
        lines.extend(textwrap.wrap(help_text, WIDTH, initial_indent="    ", subsequent_indent="    "))
    return "\n".join([*lines, "```"])


def environment() -> str:
    return "\n".join(f"- `{name}`: {what}" for name, what in ENVIRONMENT.items())


def renderers(root: Path = ROOT) -> dict[str, Callable[[], str]]:
    """Every generated part of the docs, by name."""
    return {"commands": commands, "environment": environment, **docs.renderers(root)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchline.cli.usage", description=__doc__)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", type=Path, metavar="DOCS", help="render every generated part of the pages in DOCS")
    action.add_argument("--check", type=Path, metavar="DOCS", help="exit 1 when a page's generated part differs")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose pyproject.toml is drawn")
    args = parser.parse_args(argv)
    folder: Path | None = args.write or args.check
    if folder is None:
        print(commands())
        return 0
    outcome = docs.render_pages(folder, renderers(args.root), write=bool(args.write))
    for name in outcome.unplaced:
        print(f"{folder}: no page holds the generated part {name!r}", file=sys.stderr)
    for page in outcome.stale:
        print(f"{page}: {'rendered from the code' if args.write else 'differs from the code; run `make docs`'}",
              file=sys.stderr)
    return 1 if outcome.unplaced or (args.check and outcome.stale) else 0


if __name__ == "__main__":
    raise SystemExit(main())
