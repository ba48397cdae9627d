"""Preemption notices from the cloud's metadata service (I5).

A spot or preemptible machine is told shortly before it is taken away: AWS
posts a spot interruption notice about two minutes ahead
(`/latest/meta-data/spot/instance-action` on the instance metadata service,
read with an IMDSv2 session token), and Google Cloud sets the instance's
`preempted` metadata value about thirty seconds ahead. A watcher polls for
that notice in a daemon thread and, when it comes, sets the worker's stop
event, exactly as SIGTERM does: the worker stops taking records, finishes what
is in flight within `shards.grace_seconds`, writes it, gives its lease back
and exits 75. So the time from notice to a free GPU is bounded by the poll
interval plus the grace period.

The watcher never stops a worker because the metadata service is unreachable
or answers oddly: only a positive notice does. It logs the first failure of
each kind and keeps polling.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Protocol

AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"
# How long an IMDSv2 token lives; it is fetched again when it runs out or is refused.
AWS_TOKEN_TTL_SECONDS = 21600
DEFAULT_INTERVAL_SECONDS = 2.0
REQUEST_TIMEOUT_SECONDS = 1.0
KINDS = ("none", "aws", "gcp")


class NoticeSource(Protocol):
    name: str

    def check(self) -> str | None:
        """A description of the notice when there is one, else None. May raise OSError."""
        ...


class AwsSpotNotice:
    """The EC2 spot interruption notice, through IMDSv2 (a session token on every read)."""

    name = "aws"

    def __init__(self, base_url: str = AWS_METADATA_URL, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._token: str | None = None
        self._token_expires = 0.0

    def _fetch_token(self) -> str:
        request = urllib.request.Request(
            f"{self.base_url}/latest/api/token", method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECONDS)})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            token = str(response.read().decode()).strip()
        # Renewed a minute early, so a token never expires between fetch and use.
        self._token, self._token_expires = token, time.monotonic() + AWS_TOKEN_TTL_SECONDS - 60
        return token

    def check(self) -> str | None:
        token = self._token if self._token and time.monotonic() < self._token_expires else self._fetch_token()
        for attempt in range(2):
            request = urllib.request.Request(f"{self.base_url}/latest/meta-data/spot/instance-action",
                                             headers={"X-aws-ec2-metadata-token": token})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read().decode()
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None  # no interruption scheduled
                if exc.code == 401 and attempt == 0:
                    token = self._fetch_token()  # the token expired or was revoked
                    continue
                raise
            try:
                action = json.loads(body)
                return f"AWS spot interruption notice: {action.get('action')} at {action.get('time')}"
            except (ValueError, AttributeError):
                return f"AWS spot interruption notice: {body.strip()[:200]}"
        return None


class GcpPreemptedNotice:
    """Google Cloud's `preempted` instance metadata value (TRUE once the VM is being preempted)."""

    name = "gcp"

    def __init__(self, base_url: str = GCP_METADATA_URL, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def check(self) -> str | None:
        request = urllib.request.Request(f"{self.base_url}/computeMetadata/v1/instance/preempted",
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            value = response.read().decode().strip()
        return "Google Cloud preemption notice (instance/preempted is TRUE)" if value.upper() == "TRUE" else None


class NoticeWatcher:
    """Polls a notice source in a daemon thread and sets `stop` when the notice comes."""

    def __init__(self, source: NoticeSource, stop: threading.Event, *,
                 interval: float = DEFAULT_INTERVAL_SECONDS, log: Callable[[str], None] = lambda _m: None) -> None:
        self.source = source
        self.stop = stop
        self.interval = interval
        self.log = log
        self.notice: str | None = None
        self.noticed_at: float | None = None  # time.monotonic() when the notice was seen
        self._failures: set[str] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"notice-{source.name}", daemon=True)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=self.interval + REQUEST_TIMEOUT_SECONDS + 1)

    def _run(self) -> None:
        while not (self._closed.is_set() or self.stop.is_set()):
            try:
                notice = self.source.check()
            except (OSError, ValueError) as exc:
                kind = type(exc).__name__
                if kind not in self._failures:
                    self._failures.add(kind)
                    self.log(f"cannot read the {self.source.name} preemption notice ({exc}); still watching")
                notice = None
            if notice is not None:
                self.notice, self.noticed_at = notice, time.monotonic()
                self.log(f"{notice}: stopping")
                self.stop.set()
                return
            self._closed.wait(self.interval)


def source_for(kind: str, base_url: str | None = None) -> NoticeSource | None:
    if kind == "none":
        return None
    if kind == "aws":
        return AwsSpotNotice(base_url or AWS_METADATA_URL)
    if kind == "gcp":
        return GcpPreemptedNotice(base_url or GCP_METADATA_URL)
    raise ValueError(f"unknown preemption notice {kind!r}: use one of {', '.join(KINDS)}")


def start_watcher(kind: str, stop: threading.Event, *, base_url: str | None = None,
                  interval: float = DEFAULT_INTERVAL_SECONDS,
                  log: Callable[[str], None] = lambda _m: None) -> NoticeWatcher | None:
    """Starts watching for `kind`'s notice ('none' starts nothing); the worker passes its stop event."""
    source = source_for(kind, base_url)
    if source is None:
        return None
    return NoticeWatcher(source, stop, interval=interval, log=log).start()
