"""Worker log lines: plain text for a terminal, or one JSON object a line
(`batchline worker --log-format json`) for a log pipeline (Loki, Elasticsearch,
Cloud Logging) that indexes fields instead of grepping text.

Every JSON line has `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`,
`worker`, `pid` and `msg`; fields passed with `extra=` are kept as fields, and
an exception becomes `exc`. Messages can quote record ids and engine errors,
which are untrusted text: JSON encoding keeps a newline or a quote in them from
splitting or forging a line.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import IO, Any

LOG_FORMATS = ("text", "json")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, worker_id: str | None = None) -> None:
        super().__init__()
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        ts = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "worker": self.worker_id,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_worker_logging(fmt: str, worker_id: str, stream: IO[str] | None = None,
                             level: int = logging.INFO) -> logging.Logger:
    """Sets up the root logger of a worker process and returns the worker's logger."""
    if fmt not in LOG_FORMATS:
        from batchline.errors import BatchlineError

        raise BatchlineError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker_id))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {worker_id} %(message)s"))
    root = logging.getLogger()
    # Replacing, not adding: a second configuration in one process would print every line twice.
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request at INFO: a line per poll of every batch at a provider.
    # The worker says what each call meant; httpx speaks up only for warnings.
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))
    return logging.getLogger("batchline.worker")
