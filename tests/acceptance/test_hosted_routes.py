"""Hosted routes end to end: real workers, the real store, and a stand-in for each
provider's batch API (tests/fakes/provider_servers.py; the real services cannot be
reached from here).

Each test checks from the store that every record has exactly one outcome (I1),
that only records of cleared classes ever reached the provider, and from the
stand-in how many batches were created (a batch created twice is paid twice).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchline.ops.report.data import collect
from batchline.ops.report.page import write_report
from batchline.plan.planner import plan
from batchline.spec import load_spec
from batchline.store import Store
from batchline.targets.files import export_jsonl
from batchline.worker.supervisor import Worker
from batchline.worker.telemetry import WorkerTelemetry
from tests.fakes.provider_servers import anthropic_batch_server, openai_batch_server
from tests.helpers import check_invariants, start_worker, stop_all, wait_for

pytestmark = pytest.mark.acceptance

KEY_ENV = "BATCHLINE_TEST_PROVIDER_KEY"
SERVED = {"openai": "gpt-4o-mini-2024-07-18", "anthropic": "claude-haiku-4-5-20251001"}


@pytest.fixture(params=["openai", "anthropic"])
def provider(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    server_of = openai_batch_server if request.param == "openai" else anthropic_batch_server
    with server_of() as server:
        monkeypatch.setenv(KEY_ENV, server.api_key)
        server.served_model = SERVED[request.param]
        server.api = request.param
        yield server


def classed(n: int, cleared_every: int = 1) -> list[dict[str, Any]]:
    """Records r000..; every `cleared_every`-th is 'public', the rest 'restricted' (or unclassed)."""
    out = []
    for i in range(n):
        record: dict[str, Any] = {"id": f"r{i:03d}", "text": f"ticket {i}: printer {i % 5} jams", "acl": ["g"]}
        if i % cleared_every == 0:
            record["data_class"] = "public"
        elif i % 2:
            record["data_class"] = "restricted"
        out.append(record)
    return out


def job(job_factory: Any, server: Any, records: list[dict[str, Any]], **provider: Any) -> Path:
    rules = {"class_field": "data_class", "providers": {"hosted": {
        "api": server.api, "model": SERVED[server.api].rsplit("-", 1)[0], "classes": ["public"],
        "retention": "30 days, then deleted", "base_url": server.base_url, "api_key_env": KEY_ENV,
        "poll_seconds": 0.05, "prices": {"input_per_mtok": 0.075, "output_per_mtok": 0.30}, **provider}}}
    return job_factory(records, routing=rules, shards={"size": 10, "max_attempts": 2})


def run_worker(store: Store, version: str) -> int:
    return Worker(store, version=version, poll_seconds=0.02).run()


def sent_ids(server: Any) -> list[str]:
    return [line["custom_id"] for s in server.submissions for line in s["lines"]]


def test_only_cleared_records_reach_the_provider_and_every_result_names_its_model(
        job_factory: Any, store: Store, provider: Any, tmp_path: Path) -> None:
    records = classed(30, cleared_every=3)
    spec = load_spec(job(job_factory, provider, records))
    version = plan(spec, store).version
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert not dead and len(results) == 30
    cleared = {r["id"] for r in records if r.get("data_class") == "public"}
    assert sorted(sent_ids(provider)) == sorted(cleared)  # nothing else left, and each cleared one once
    everything_sent = json.dumps([s["lines"] for s in provider.submissions])
    for r in records:
        if r["id"] not in cleared:
            assert r["text"] not in everything_sent, f"{r['id']} is not cleared but its text was sent"
    models = {r.record_id: r.model for r in store.iter_results(version)}
    assert {models[i] for i in cleared} == {SERVED[provider.api]}
    assert {models[i] for i in set(models) - cleared} == {"synthetic"}
    export_jsonl(store, version, tmp_path / "out.jsonl")
    exported = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {e["id"]: e["model"] for e in exported} == models
    # The provider's retention was said before the first record went.
    events = store.events(version, ["provider_notice", "submitted"])
    assert [e.kind for e in events][:2] == ["provider_notice", "submitted"]
    assert events[0].detail["retention"] == "30 days, then deleted"
    data = collect(store, version)
    assert (data.routes["hosted"].records, data.routes["hosted"].results) == (10, 10)
    assert data.routes["local"].records == 20
    page = write_report(store, version, tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert page.routes["hosted"].input_tokens > 0
    assert "Where records went" in html and "30 days, then deleted" in html and "tokens at batch prices" in html


def test_expired_requests_are_sent_again_and_not_charged(job_factory: Any, store: Store, provider: Any) -> None:
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    provider.expire_ids = _Once({"r002", "r007"})
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert len(results) == 10 and not dead
    assert [len(s["lines"]) for s in provider.submissions] == [10, 2]
    assert sorted(sent_ids(provider)[10:]) == ["r002", "r007"]
    attempts = {r.record_id: r.attempt for r in store.iter_results(version)}
    assert attempts["r002"] == attempts["r007"] == 1  # expiry is the provider's, not the record's


def test_errored_requests_are_charged_and_end_as_dead_letters(job_factory: Any, store: Store,
                                                              provider: Any) -> None:
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    provider.error_ids = {"r004"}
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert dead == {"r004"} and len(results) == 9
    [letter] = list(store.iter_dead_letters(version))
    assert (letter.kind, letter.attempts) == ("provider_error", 2)
    # The second batch carried only the record still without an answer: nothing is paid for twice.
    assert [len(s["lines"]) for s in provider.submissions] == [10, 1]


def test_a_duplicated_answer_keeps_the_first_and_writes_one_result(job_factory: Any, store: Store,
                                                                   provider: Any) -> None:
    first = {"category": "a", "summary": "first answer"}
    provider.answer = lambda custom_id, body: json.dumps(first)
    provider.duplicate_answer = lambda custom_id, body: json.dumps({"category": "b", "summary": "second"})
    provider.duplicate_ids = {"r003"}
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    assert run_worker(store, version) == 0
    results, _ = check_invariants(store, version, spec)
    assert len(results) == 10
    stored = store.results_for(version, ["r003"])["r003"]
    assert json.loads(stored.output) == first
    [collected] = store.events(version, ["provider_collected"])
    assert collected.detail["duplicates"] == 1 and collected.detail["results"] == 10


def test_a_batch_the_provider_refuses_whole_ends_in_dead_letters_not_a_loop(
        job_factory: Any, store: Store, provider: Any) -> None:
    provider.fail_batch = True
    spec = load_spec(job(job_factory, provider, classed(6)))
    version = plan(spec, store).version
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert not results and len(dead) == 6
    assert {d.kind for d in store.iter_dead_letters(version)} == {"provider_error"}


def test_a_batch_in_flight_is_polled_by_whoever_claims_it(job_factory: Any, store: Store, provider: Any) -> None:
    provider.complete_after_polls = 3
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    assert run_worker(store, version) == 0
    check_invariants(store, version, spec)
    assert len(provider.submissions) == 1
    waits = store.events(version, ["provider_wait"])
    assert len(waits) >= 3  # parked between polls, holding no lease
    assert all(e.detail["batch_id"] == provider.submissions[0]["id"] for e in waits)


def test_a_worker_killed_between_submit_and_download_is_not_submitted_again(
        job_factory: Any, store: Store, store_url: str, provider: Any, tmp_path: Path) -> None:
    provider.complete_after_polls = 10**9  # in flight until the test lets it end
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    first = start_worker(store_url, version, log=tmp_path / "w1.log", poll=0.05)
    procs = [first]
    try:
        wait_for(lambda: any(r.state == "submitted" for r in store.shard_rows(version)), 60, "a submitted shard")
        wait_for(lambda: provider.polls >= 2, 60, "the worker to poll the batch")
        first.send_signal(signal.SIGKILL)
        first.wait()
        provider.complete_after_polls = 0
        second = start_worker(store_url, version, log=tmp_path / "w2.log", poll=0.05)
        procs.append(second)
        # A poll lease the dead worker held must run out first: the clock is moved, not waited on.
        store.shift_clock(60.0)
        assert second.wait(timeout=120) == 0, (tmp_path / "w2.log").read_text()[-2000:]
    finally:
        stop_all(procs)
    results, dead = check_invariants(store, version, spec)
    assert len(results) == 10 and not dead
    assert len(provider.submissions) == 1, "the batch was submitted again"


class _DiesAfterSubmitting:
    """Wraps a provider: creates the batch, then the worker dies before recording its id."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.api = inner.api

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(self, requests: Any, tag: str) -> Any:
        self.inner.submit(requests, tag)
        raise _WorkerDied


class _WorkerDied(BaseException):
    pass


def test_a_worker_dead_before_recording_its_batch_id_is_adopted_not_resubmitted(
        job_factory: Any, store: Store, provider: Any) -> None:
    from batchline.providers import open_provider

    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    doomed = Worker(store, version=version, poll_seconds=0.02)
    assert spec.routing is not None
    inner = open_provider(spec.routing.providers[0], spec.decoding, spec.output_schema, spec.name)
    doomed._job(version).providers["hosted"] = _DiesAfterSubmitting(inner)
    with pytest.raises(_WorkerDied):
        doomed.run()
    [row] = store.shard_rows(version)
    assert row.state == "leased" and row.batch_id is None  # only the intent is on record
    store.shift_clock(120.0)  # its lease runs out
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert len(results) == 10 and not dead
    assert len(provider.submissions) == 1, "a second batch was created for the same records"


class _Once(set[str]):
    """Ids that expire in the first batch that holds them, and are answered after that."""

    def __init__(self, ids: set[str]) -> None:
        super().__init__(ids)
        self.seen: set[str] = set()

    def __contains__(self, item: object) -> bool:
        if not super().__contains__(item) or item in self.seen:
            return False
        self.seen.add(str(item))
        return True


def test_a_worker_lets_its_engine_go_while_only_provider_batches_are_left(
        job_factory: Any, store: Store, provider: Any) -> None:
    import threading

    provider.complete_after_polls = 10**9
    spec = load_spec(job(job_factory, provider, classed(20, cleared_every=2)))
    version = plan(spec, store).version
    worker = Worker(store, version=version, poll_seconds=0.02)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(worker.run()))
    thread.start()
    try:
        wait_for(lambda: all(r.state == "done" for r in store.shard_rows(version) if r.route == "local")
                 and any(r.state == "submitted" for r in store.shard_rows(version)), 60, "local work done")
        # The engine child (which holds the GPU) is closed while the batch is at the provider.
        wait_for(lambda: worker._engine is None, 10, "the engine to be closed")
        provider.complete_after_polls = 0
        thread.join(60)
    finally:
        worker.stop.set()
        thread.join(60)
    assert exit_code == [0]
    check_invariants(store, version, spec)


def test_a_worker_without_the_routes_key_stops_before_claiming_its_shards(
        job_factory: Any, store: Store, provider: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.errors import EngineFatal

    monkeypatch.delenv(KEY_ENV)
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    with pytest.raises(EngineFatal, match=f"needs an API key in the environment variable {KEY_ENV}, which is not "
                                          "set; a worker that is not to call providers takes --routes local"):
        run_worker(store, version)
    assert not store.events(version, ["claim"]) and not provider.submissions
    # A worker told to leave the providers alone finishes the local work and exits at once.
    mixed = load_spec(job(job_factory, provider, classed(10, cleared_every=2)))
    mixed_version = plan(mixed, store).version
    assert Worker(store, version=mixed_version, poll_seconds=0.02, routes=["local"]).run() == 0
    assert {r.route for r in store.shard_rows(mixed_version) if r.state != "done"} == {"hosted"}


def test_a_record_the_provider_lets_expire_batch_after_batch_is_given_up_on(
        job_factory: Any, store: Store, provider: Any) -> None:
    provider.expire_ids = {"r005"}  # every batch lets it expire
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    assert run_worker(store, version) == 0
    results, dead = check_invariants(store, version, spec)
    assert dead == {"r005"} and len(results) == 9
    [letter] = list(store.iter_dead_letters(version))
    assert letter.kind == "provider_expired" and "2 batches in a row" in letter.error
    assert sent_ids(provider).count("r005") == 2  # max_attempts batches, and no more
    assert not store.attempts(version, ["r005"])  # never charged: the provider's delay, not the record's fault


class _Renewals(WorkerTelemetry):
    def __init__(self) -> None:
        self.renewed_ok = 0

    def renewed(self, ok: bool) -> None:
        self.renewed_ok += ok


class _FastClock:
    """A monotonic clock that moves a minute per reading: every renewal check is due."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        self.t += 60.0
        return self.t


def test_a_hosted_shard_reports_its_renewals(job_factory: Any, store: Store, provider: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: the hosted run renewed through its own copy of renew, which never told the
    # worker's telemetry, so hosted renewals were missing from the renewal metric.
    import batchline.worker.shard as shard

    monkeypatch.setattr(shard, "time", _FastClock())
    spec = load_spec(job(job_factory, provider, classed(10)))
    version = plan(spec, store).version
    provider.error_ids = {"r001", "r004"}
    telemetry = _Renewals()
    assert Worker(store, version=version, poll_seconds=0.02, telemetry=telemetry).run() == 0
    check_invariants(store, version, spec)
    assert telemetry.renewed_ok >= 2  # one per charged error at least, each due on this clock
