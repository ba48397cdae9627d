"""What a worker reports about itself while it runs (metrics, structured logs).

The supervisor calls these hooks; the default does nothing, so the core needs
no metrics library. `batchline.ops.metrics` implements them for Prometheus.
"""

from __future__ import annotations


class WorkerTelemetry:
    def claimed(self, version: str) -> None:
        """A shard lease was granted."""

    def renewed(self, ok: bool) -> None:
        """A renewal succeeded, or found the lease lost."""

    def taken_back(self, n: int) -> None:
        """Leases of workers proven dead were ended at once (instead of running out)."""

    def read_across_regions(self, n: int) -> None:
        """Input bytes read from outside the worker's region (`--region`)."""

    def stale_epoch(self, op: str) -> None:
        """A fenced write (put, completion, charge, renewal) was refused."""

    def outcome(self, kind: str, n: int = 1) -> None:
        """Records that reached an outcome: result, dead_letter, retry, too_long."""

    def engine_batch(self, records: int, seconds: float, input_tokens: int, output_tokens: int) -> None:
        """A batch sent to the engine child completed: its size, latency and tokens."""

    def engine_failure(self, kind: str) -> None:
        """The engine child crashed or missed a batch deadline."""

    def in_flight(self, n: int) -> None:
        """Records sent to the engine and not yet answered."""
