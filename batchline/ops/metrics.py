"""Prometheus metrics for a worker: `batchline worker --metrics-port PORT`.

The supervisor reports through the `WorkerTelemetry` hooks; this class turns
them into counters, histograms and gauges named by Prometheus conventions
(`batchline_` prefix, `_total` counters, `_seconds` histograms, labels for
outcome and op) and serves them over HTTP from a daemon thread, so a scrape
never waits on the claim loop and the loop never waits on a scrape.

Each instance has its own registry: several workers in one process (tests,
an embedding application) do not collide, and the process-wide default
registry of the host application is left alone.
"""

from __future__ import annotations

import threading
from typing import Any

from batchline.errors import BatchlineError
from batchline.store.model import FENCED_OPS
from batchline.worker.telemetry import WorkerTelemetry

# The client is an optional extra: a worker without --metrics-port never needs it.
try:
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        Info,
        ProcessCollector,
        start_http_server,
    )
    _MISSING: str | None = None
except ImportError as exc:  # pragma: no cover - only where the extra is not installed
    _MISSING = str(exc)

# The outcome and op values the supervisor reports. Creating their series up
# front makes them scrape as 0 rather than be absent, so rate() and alerts on
# a series that has not happened yet (a first stale epoch) work from the start.
OUTCOMES = ("result", "dead_letter", "retry", "too_long")
STALE_OPS = FENCED_OPS
FAILURE_KINDS = ("crash", "hang")

# Batches run from tens of milliseconds (a small model, short records) to the
# batch deadline (minutes); tokens per batch span a few to hundreds of thousands.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0)
BATCH_SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)


def _require_client() -> None:
    if _MISSING is not None:
        raise BatchlineError(f"--metrics-port needs prometheus_client ({_MISSING}): "
                             "pip install 'batchline[metrics]'")


class PrometheusTelemetry(WorkerTelemetry):
    def __init__(self, worker_id: str | None = None) -> None:
        _require_client()
        self.registry = CollectorRegistry()
        r = self.registry
        self.records = Counter("batchline_records", "Records that reached an outcome in this worker",
                               ["outcome"], registry=r)
        self.claims = Counter("batchline_lease_claims", "Shard leases granted to this worker", registry=r)
        self.renewals = Counter("batchline_lease_renewals", "Lease renewals, by whether the lease was still held",
                                ["result"], registry=r)
        self.take_backs = Counter("batchline_lease_take_backs",
                                  "Leases of workers proven dead that this worker ended at once", registry=r)
        self.stale = Counter("batchline_stale_epoch_refusals",
                             "Fenced writes the store refused because this worker's lease epoch was stale",
                             ["op"], registry=r)
        self.failures = Counter("batchline_engine_failures",
                                "Engine child crashes and missed batch deadlines", ["kind"], registry=r)
        self.batch_seconds = Histogram("batchline_engine_batch_seconds",
                                       "Time from sending a batch to the engine child to its last answer",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.batch_records = Histogram("batchline_engine_batch_records", "Records per engine batch",
                                       buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("batchline_engine_batch_tokens", "Tokens per engine batch",
                                      ["direction"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("batchline_engine_tokens", "Tokens through the engine", ["direction"], registry=r)
        self.cross_region = Counter("batchline_cross_region_read_bytes",
                                    "Input bytes this worker read from outside its region", registry=r)
        self.in_flight_records = Gauge("batchline_records_in_flight",
                                       "Records sent to the engine child and not yet answered", registry=r)
        if worker_id is not None:
            Info("batchline_worker", "The worker this process runs", registry=r).info({"worker": worker_id})
        # Memory, CPU and open files of the supervisor, as the default registry would have them.
        ProcessCollector(registry=r)
        for outcome in OUTCOMES:
            self.records.labels(outcome=outcome)
        for op in STALE_OPS:
            self.stale.labels(op=op)
        for kind in FAILURE_KINDS:
            self.failures.labels(kind=kind)
        for result in ("ok", "lost"):
            self.renewals.labels(result=result)
        for direction in ("input", "output"):
            self.tokens.labels(direction=direction)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # --- the hooks -------------------------------------------------------------

    def claimed(self, version: str) -> None:
        # No version label: a long-lived worker sees many versions, and each would
        # be a series forever; the store's event log has claims by version.
        self.claims.inc()

    def renewed(self, ok: bool) -> None:
        self.renewals.labels(result="ok" if ok else "lost").inc()

    def taken_back(self, n: int) -> None:
        self.take_backs.inc(n)

    def read_across_regions(self, n: int) -> None:
        self.cross_region.inc(n)

    def stale_epoch(self, op: str) -> None:
        self.stale.labels(op=op or "unknown").inc()

    def outcome(self, kind: str, n: int = 1) -> None:
        self.records.labels(outcome=kind).inc(n)

    def engine_batch(self, records: int, seconds: float, input_tokens: int, output_tokens: int) -> None:
        self.batch_seconds.observe(seconds)
        self.batch_records.observe(records)
        self.batch_tokens.labels(direction="input").observe(input_tokens)
        self.batch_tokens.labels(direction="output").observe(output_tokens)
        self.tokens.labels(direction="input").inc(input_tokens)
        self.tokens.labels(direction="output").inc(output_tokens)

    def engine_failure(self, kind: str) -> None:
        self.failures.labels(kind=kind).inc()

    def in_flight(self, n: int) -> None:
        self.in_flight_records.set(n)

    # --- serving ---------------------------------------------------------------

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves /metrics on a daemon thread; returns the bound port (useful with port 0)."""
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise BatchlineError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
        bound: int = self._server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def serve_metrics(port: int, *, worker_id: str | None = None, addr: str = "0.0.0.0") -> PrometheusTelemetry:
    """What `batchline worker --metrics-port` calls: metrics for this worker, served at once."""
    telemetry = PrometheusTelemetry(worker_id)
    telemetry.serve(port, addr)
    return telemetry


class PaceMetrics:
    """Gauges of a pacer (`batchline pace --metrics-port PORT`): what it saw and decided at its
    last tick, as `status` says it."""

    MODES = ("on time", "holding", "behind", "safety net", "at risk", "done")

    def __init__(self, version: str) -> None:
        _require_client()
        r = self.registry = CollectorRegistry()
        self.committed = Gauge("batchline_pace_committed_records", "Records committed (results and dead letters)",
                               registry=r)
        self.expected = Gauge("batchline_pace_expected_records", "Records the line to the deadline expects by now",
                              registry=r)
        self.records = Gauge("batchline_pace_records", "Records of the version", registry=r)
        self.deadline = Gauge("batchline_pace_deadline_timestamp_seconds", "The deadline", registry=r)
        self.workers = Gauge("batchline_pace_workers", "Workers the store has seen, by kind", ["kind"], registry=r)
        self.wanted = Gauge("batchline_pace_paid_workers_wanted", "Paid workers the rule wants now", registry=r)
        self.spend = Gauge("batchline_pace_paid_worker_seconds", "Paid worker-seconds used so far", registry=r)
        self.cost = Gauge("batchline_pace_paid_cost", "Paid cost so far (fallback.cost_per_worker_hour)", registry=r)
        self.mode = Gauge("batchline_pace_mode", "1 for the pacer's mode now", ["mode"], registry=r)
        Info("batchline_pace", "The version paced", registry=r).info({"version": version})
        for kind in ("spot", "paid", "paid_not_admitted"):
            self.workers.labels(kind=kind)
        for mode in self.MODES:
            self.mode.labels(mode=mode)
        self._server: Any = None

    def observe(self, report: Any) -> None:
        """Sets every gauge from a tick's report (batchline.launch.pacer.PaceReport)."""
        self.committed.set(report.committed)
        self.expected.set(report.decision.expected)
        self.records.set(report.records)
        self.deadline.set(report.deadline)
        self.workers.labels(kind="spot").set(report.spot_workers)
        self.workers.labels(kind="paid").set(report.paid_seen)
        self.workers.labels(kind="paid_not_admitted").set(report.paid_not_admitted)
        self.wanted.set(report.decision.paid)
        self.spend.set(report.paid_spend_seconds)
        self.cost.set(report.cost)
        for mode in self.MODES:
            self.mode.labels(mode=mode).set(1 if str(report.decision.mode) == mode else 0)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        try:
            self._server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise BatchlineError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
        bound: int = self._server.server_address[1]
        return bound
