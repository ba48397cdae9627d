"""The fault drill: one short drill on SQLite with real workers, then its checker run
again on copies of the store broken on purpose, to show each check can fail."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchline.cli import observe
from batchline.errors import BatchlineError
from batchline.ops.drill.checks import POISON_KINDS, Fault, check_job, fault_checks
from batchline.store import Store, open_store

pytestmark = pytest.mark.acceptance


def cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="batchline")
    observe.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code: int = args.func(args)
    return code, out.getvalue()


@dataclass
class Drilled:
    db: Path
    result: dict[str, Any]
    report: Path

    @property
    def version(self) -> str:
        return str(self.result["faulted"]["version"])


@pytest.fixture(scope="module")
def drilled(tmp_path_factory: pytest.TempPathFactory) -> Drilled:
    work = tmp_path_factory.mktemp("drill")
    db = work / "drill.db"
    report = work / "drill.html"
    code, out = cli("drill", "--store", f"sqlite:///{db}", "--workers", "2", "--minutes", "0.5", "--seed", "11",
                    "--work-dir", str(work / "run"), "--report", str(report), "--json")
    result = json.loads(out)
    assert code == 0, json.dumps(result["checks"], indent=1)
    # Named as messages name a store: a URL could hold a password.
    assert result["store"] == str(db) and "store_url" not in result
    return Drilled(db, result, report)


@pytest.fixture
def broken(drilled: Drilled, tmp_path: Path) -> Iterator[tuple[Store, sqlite3.Connection, str]]:
    """A copy of the drill's store to break: the backup API copies a WAL database whole."""
    copy = tmp_path / "broken.db"
    src, dst = sqlite3.connect(drilled.db), sqlite3.connect(copy)
    src.backup(dst)
    src.close()
    store = open_store(f"sqlite:///{copy}")
    yield store, dst, f"sqlite:///{copy}"
    dst.close()
    store.close()


def checks_of(store: Store, version: str, tmp_path: Path) -> dict[str, bool]:
    _figures, checks = check_job(store, version, work_dir=tmp_path, validate_gate=False)
    return {c.name: c.passed for c in checks}


def test_the_drill_hurts_every_kind_and_every_check_passes(drilled: Drilled) -> None:
    r = drilled.result
    assert r["passed"] is True and all(c["passed"] for c in r["checks"])
    kinds = r["faults_by_kind"]
    assert kinds["kill9"] >= 1 and kinds["sigstop"] >= 1 and kinds["sigterm"] >= 1
    assert all(kinds[f"poison_{k}"] >= 1 for k in POISON_KINDS.values())
    f = r["figures"]
    poison = {rid for ids in r["poison"].values() for rid in ids}
    assert f["records"] == f["results"] + f["dead_letters"] == r["faulted"]["records"]
    assert f["dead_letters"] == len(poison)
    assert f["records_lost"] == f["duplicate_results"] == f["duplicate_in_export"] == 0
    assert f["result_and_dead_letter"] == 0
    # A stalled worker woke up and was refused; killed and stalled leases expired and were re-leased.
    assert f["stale_refused"] >= 1
    assert f["leases_expired"] >= kinds["kill9"] + kinds["sigstop"] - sum(
        1 for x in r["faults"] if x["shard_no"] is None)
    assert r["faulted"]["worker_starts"] > r["workers"]  # the killed and the stopped were replaced
    assert r["baseline"]["makespan"] > 0 and r["faulted"]["makespan"] > 0


def test_the_report_of_a_drill_shows_the_faults(drilled: Drilled) -> None:
    text = drilled.report.read_text(encoding="utf-8")
    assert 'class="lease expired"' in text and 'class="relink"' in text
    assert "stale epoch" in text and "engine crashed" in text
    assert "taken out of the axis" in text  # the clock shifts are not shown as time


def test_a_deleted_result_is_a_record_lost(drilled: Drilled, broken: Any, tmp_path: Path) -> None:
    store, db, url = broken
    (victim,) = db.execute("SELECT record_id FROM results WHERE version = ? ORDER BY record_id LIMIT 1",
                           (drilled.version,)).fetchone()
    db.execute("DELETE FROM results WHERE version = ? AND record_id = ?", (drilled.version, victim))
    db.commit()
    figures, checks = check_job(store, drilled.version, work_dir=tmp_path, validate_gate=False)
    assert figures.records_lost == 1 and figures.lost_sample == [victim]
    assert {c.name: c.passed for c in checks}["no record lost"] is False
    code, out = cli("drill", "--check", drilled.version, "--store", url, "--work-dir", str(tmp_path))
    assert code == 1
    assert f"FAIL  no record lost: 1 of {figures.records:,} planned ids without an outcome (e.g. {victim})" in out


def test_a_dead_letter_beside_a_result_is_a_duplicate_answer(drilled: Drilled, broken: Any, tmp_path: Path) -> None:
    store, db, _url = broken
    (rid, shard) = db.execute("SELECT record_id, shard_no FROM results WHERE version = ? LIMIT 1",
                              (drilled.version,)).fetchone()
    db.execute("INSERT INTO dead_letters (version, record_id, shard_no, kind, error, attempts, created_at) "
               "VALUES (?, ?, ?, 'crash', 'inserted by the test', 3, 0)", (drilled.version, rid, shard))
    db.commit()
    figures, checks = check_job(store, drilled.version, work_dir=tmp_path, validate_gate=False)
    assert figures.result_and_dead_letter == 1
    passed = {c.name: c.passed for c in checks}
    assert passed["I1 one outcome per record"] is False
    assert passed["I4 poison costs only itself"] is False  # a healthy record is now a dead letter
    assert passed["no record lost"] is True


def test_a_charged_batch_mate_a_wrong_kind_and_a_late_write_each_fail_their_check(
        drilled: Drilled, broken: Any, tmp_path: Path) -> None:
    store, db, _url = broken
    poison = {rid for ids in drilled.result["poison"].values() for rid in ids}
    healthy = next(r.record_id for r in store.iter_results(drilled.version) if r.record_id not in poison)
    store.log_event("attempt_failed", version=drilled.version, worker="test", shard_no=0, epoch=1,
                    detail={"record_id": healthy, "kind": "crash", "attempts": 1})
    assert checks_of(store, drilled.version, tmp_path)["I4 batch-mates never charged"] is False

    hang = drilled.result["poison"]["hang_on"][0]
    db.execute("UPDATE dead_letters SET kind = 'crash' WHERE version = ? AND record_id = ?",
               (drilled.version, hang))
    (sealed_at,) = db.execute("SELECT MAX(ts) FROM events WHERE version = ? AND kind = 'seal'",
                              (drilled.version,)).fetchone()
    db.execute("UPDATE results SET created_at = ? WHERE version = ? AND record_id = ?",
               (sealed_at + 5, drilled.version, healthy))
    db.commit()
    passed = checks_of(store, drilled.version, tmp_path)
    assert passed["I4 poison costs only itself"] is False
    assert passed["I3 sealed, nothing written after"] is False
    assert passed["I1 one outcome per record"] is True


def test_a_late_write_of_a_stalled_worker_and_a_missing_expiry_fail_the_fault_checks(
        drilled: Drilled, broken: Any) -> None:
    store, db, _url = broken
    faults = [Fault(**f) for f in drilled.result["faults"]]
    assert all(c.passed for c in fault_checks(store, drilled.version, faults))
    stall = next((f for f in faults if f.kind == "sigstop" and f.reclaimed_at is not None), None)
    if stall is None:
        pytest.skip("this drill's stalled worker held no lease when it was stopped")
    # Make one record look written by the stalled worker, under its old epoch, after the take-over.
    (rid,) = db.execute("SELECT record_id FROM results WHERE version = ? AND shard_no = ? LIMIT 1",
                        (drilled.version, stall.shard_no)).fetchone()
    db.execute("UPDATE results SET worker = ?, epoch = ?, created_at = ? WHERE version = ? AND record_id = ?",
               (stall.worker, stall.epoch, stall.reclaimed_at + 1, drilled.version, rid))
    # And make a killed worker's lease look as if it never expired.
    killed = next(f for f in faults if f.kind in ("kill9", "sigstop") and f.shard_no is not None)
    db.execute("DELETE FROM events WHERE version = ? AND kind = 'lease_expired' AND worker = ? AND shard_no = ?",
               (drilled.version, killed.worker, killed.shard_no))
    db.commit()
    passed = {c.name: c.passed for c in fault_checks(store, drilled.version, faults)}
    assert passed["stalled workers fenced off"] is False
    assert passed["every fault is in the event log"] is False


def test_drill_refuses_what_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(BatchlineError, match="--workers must be at least 2"):
        cli("drill", "--workers", "1", "--work-dir", str(tmp_path))
    with pytest.raises(BatchlineError, match="--check needs the --store"):
        cli("drill", "--check", "x@y")
    with pytest.raises(BatchlineError, match=r"empty\.db does not exist"):
        cli("drill", "--check", "nope@1", "--store", f"sqlite:///{tmp_path / 'empty.db'}")
    assert not (tmp_path / "empty.db").exists()
