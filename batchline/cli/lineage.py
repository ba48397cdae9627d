"""`batchline lineage`: the lineage outbox, what was sent and what waits, and sending it now."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

from batchline.cli.common import store_command


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = store_command(sub, "lineage", "list the OpenLineage events of job versions' state changes (sent, pending, "
                                      "given up), and send what is due")
    p.add_argument("version", nargs="?", default=None, metavar="VERSION|NAME", help="one version (default: all)")
    p.add_argument("--send", action="store_true", help="send what is due now, through this process's OpenLineage "
                                                       "configuration (openlineage.yml, OPENLINEAGE_URL)")
    p.add_argument("--retry", action="store_true", help="make events given up on due again (after the receiver "
                                                        "is mended), before sending")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lineage)


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def cmd_lineage(args: argparse.Namespace) -> int:
    from batchline.api import Jobs

    outbox = Jobs(args.store).lineage(args.version, send=args.send, retry=args.retry)
    if args.json:
        print(json.dumps({"sent_now": outbox.sent, "failed_now": outbox.failed, "retried": outbox.retried,
                          "events": [{"id": r.id, "version": r.version, "kind": r.kind, "attempt": r.attempt,
                                      "at": _when(r.at), "state": r.state, "tries": r.tries,
                                      "sent_at": _when(r.sent_at), "error": r.last_error} for r in outbox.rows]},
                         indent=2))
        return 0 if not outbox.failed else 1
    for r in outbox.rows:
        error = f"  {r.last_error}" if r.last_error and r.sent_at is None else ""
        print(f"{r.id:>6}  {_when(r.at)}  {r.kind:<8}  {r.state:<8}  tries {r.tries}  {r.version}"
              f"{f' (attempt {r.attempt})' if r.attempt > 1 else ''}{error}")
    if args.send or args.retry:
        print(f"sent {outbox.sent}, failed {outbox.failed}, made due again {outbox.retried}")
    return 0 if not outbox.failed else 1
