"""The paid budget over a whole run, on both stores: a run with no spot worker at all whose
pacer buys paid workers, the store's clock moved half a minute at a time (the pacer deciding
and the paid workers heartbeating, every half second here, between moves) until the budget is
spent. The paid workers stop,
by their own heartbeat or the pacer's decision, and the spend at the end passes `max_cost` by
at most what they cost between two decisions."""

from __future__ import annotations

import io
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from batchline.ops.runner import LocalRunner
from batchline.sizing.paced import Trace
from batchline.store import Store
from tests.helpers import planned, wait_for

STEP = 30.0  # store seconds between two decisions in this test: less than a silence that is stale


def test_the_paid_budget_holds_over_a_whole_run(job_factory: Any, store: Store, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_HEARTBEAT_SECONDS", "0.5")  # inherited by the workers the runner starts
    # 3.6 an hour against a cap of 3.6: one paid worker-hour in all, for a job far longer.
    spec = job_factory(n=20_000, options={"seconds_per_record": 0.02},
                       shards={"size": 100, "lease_seconds": 10, "renew_seconds": 2, "batch_size": 8},
                       deadline="30m", fallback={"workers": 2, "cost_per_worker_hour": 3.6, "max_cost": 3.6,
                                                 "restart_overhead_seconds": 1})
    _spec, version = planned(spec, store)
    out = io.StringIO()
    runner = LocalRunner(store, version, 1, log_dir=tmp_path / "logs", out=out, spot_trace=Trace(((0.0, 0),)),
                         tick_seconds=1.0)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sum(1 for s in store.paid_slots(version) if s.seen_at and s.running) == 2,
                 what="two paid workers up")
        logs = tmp_path / "logs"

        def stopping_unrecorded() -> bool:
            # A worker that decided to stop beats on until it has finished what it holds and records
            # its stop: a move of the clock then would charge it half a minute of store time for
            # the milliseconds it took (more on a loaded machine), which no real clock does.
            said = [line for p in logs.glob("*.log") for line in p.read_text(errors="replace").splitlines()
                    if line.endswith(": stopping")]
            return any(s.running and any(f"paid slot {s.slot}/{s.generation}: " in line for line in said)
                       for s in store.paid_slots(version))

        moves = 0
        while any(s.running for s in store.paid_slots(version)):
            assert moves < 200, "the paid workers never stopped"
            wait_for(lambda: not stopping_unrecorded(), what="a stopping paid worker's stop recorded")
            if not any(s.running for s in store.paid_slots(version)):
                break
            store.shift_clock(STEP)
            moves += 1
            shifted = store.now()
            # The next decision and heartbeat of everything still running happen on the moved clock.
            wait_for(lambda at=shifted: all((s.seen_at or 0) >= at or not s.running
                                            for s in store.paid_slots(version)),
                     what="a heartbeat on the moved clock")
        wait_for(lambda: runner.paid is not None and runner.paid.alive() == 0, what="the paid processes gone")
    finally:
        runner._on_signal(signal.SIGTERM, None)
        thread.join(timeout=120)
    assert not thread.is_alive()
    spent, per_hour = store.paid_budget(version)
    assert per_hour == 0.0
    # At most one decision's worth over the cap: the two paid workers for one move of the clock.
    assert 3.6 - 2 * 3.6 * STEP / 3600.0 <= spent <= 3.6 + 2 * 3.6 * STEP / 3600.0, spent
    assert "at risk: paid budget spent" in out.getvalue() or any(
        "paid budget would be passed" in (s.stop_reason or "") for s in store.paid_slots(version))
    # The job is far from done: the budget, not the work, stopped them.
    assert store.status(version).pending > 0
