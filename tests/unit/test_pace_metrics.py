"""The pacer's Prometheus gauges say what its last tick saw and decided."""

from __future__ import annotations

import pytest

from batchline.launch.pacer import PaceReport
from batchline.sizing.pacing import Decision, Mode

prometheus_client = pytest.importorskip("prometheus_client")


def test_the_gauges_follow_the_last_tick() -> None:
    from batchline.ops.metrics import PaceMetrics

    metrics = PaceMetrics("job@1")
    report = PaceReport(Decision(3, Mode.BEHIND, 1_500.0, "behind: buying 3 paid workers"), committed=1_200,
                        records=10_000, deadline=1_800_000_000.0, spot_workers=7, paid_seen=2, paid_not_admitted=1,
                        paid_spend_seconds=5_400.0, cost=4.5, restart_overhead=120.0)
    metrics.observe(report)
    value = metrics.registry.get_sample_value
    assert value("batchline_pace_committed_records") == 1_200
    assert value("batchline_pace_expected_records") == 1_500
    assert value("batchline_pace_workers", {"kind": "spot"}) == 7
    assert value("batchline_pace_workers", {"kind": "paid_not_admitted"}) == 1
    assert value("batchline_pace_paid_workers_wanted") == 3
    assert value("batchline_pace_paid_worker_seconds") == 5_400
    assert value("batchline_pace_mode", {"mode": "behind"}) == 1
    assert value("batchline_pace_mode", {"mode": "on time"}) == 0
    assert value("batchline_pace_info", {"version": "job@1"}) == 1
