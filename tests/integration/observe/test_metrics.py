"""A worker's Prometheus endpoint, scraped over HTTP and read with prometheus_client's
own text parser, agrees with what the store recorded for the same run."""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from batchline.errors import BatchlineError
from batchline.ops.metrics import PrometheusTelemetry
from batchline.store import Store, open_store
from batchline.worker.supervisor import Worker
from tests.helpers import planned, wait_for

prometheus_parser = pytest.importorskip("prometheus_client.parser",
                                        reason="the metrics extra is not installed (pip install -e '.[metrics]')")

WORKER = "testhost:4242:metric"


@pytest.fixture
def telemetry() -> Iterator[tuple[PrometheusTelemetry, int]]:
    t = PrometheusTelemetry(WORKER)
    port = t.serve(0, "127.0.0.1")
    yield t, port
    t.close()


def scrape(port: int) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float], dict[str, str]]:
    """The raw text, every sample by (name, labels), and every family's type."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        content_type = resp.headers["Content-Type"]
        text = resp.read().decode()
    assert content_type.startswith("text/plain")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    types: dict[str, str] = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples, types


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counts_on_the_endpoint_match_the_store(job_factory: Any, store: Store, store_url: str,
                                                telemetry: tuple[PrometheusTelemetry, int]) -> None:
    t, port = telemetry
    spec = job_factory(n=120, options={"crash_on": ["r000010"], "error_on": ["r000050"],
                                       "invalid_on": ["r000090"]}, shards={"size": 40})
    _spec, version = planned(spec, store)
    worker_store = open_store(store_url)
    try:
        assert Worker(worker_store, version=version, worker_id=WORKER, poll_seconds=0.1, telemetry=t).run() == 0
    finally:
        worker_store.close()

    _text, samples, types = scrape(port)
    st = store.status(version)
    events = store.events(version)
    kinds = [e.kind for e in events]
    assert value(samples, "batchline_records_total", outcome="result") == st.results == 117
    assert value(samples, "batchline_records_total", outcome="dead_letter") == st.dead_letters == 3
    charged = kinds.count("attempt_failed")
    assert value(samples, "batchline_records_total", outcome="retry") == charged - st.dead_letters == 6
    assert value(samples, "batchline_records_total", outcome="too_long") == 0
    assert value(samples, "batchline_lease_claims_total") == kinds.count("claim") == 3
    assert value(samples, "batchline_engine_failures_total", kind="crash") == kinds.count("engine_crash") > 0
    assert value(samples, "batchline_engine_failures_total", kind="hang") == 0
    assert value(samples, "batchline_stale_epoch_refusals_total", op="put") == 0
    assert value(samples, "batchline_records_in_flight") == 0
    assert value(samples, "batchline_worker_info", worker=WORKER) == 1

    batches = value(samples, "batchline_engine_batch_seconds_count")
    assert batches > 0 and value(samples, "batchline_engine_batch_seconds_sum") > 0
    assert value(samples, "batchline_engine_batch_seconds_bucket", le="+Inf") == batches
    assert value(samples, "batchline_engine_batch_records_count") == batches
    assert value(samples, "batchline_engine_batch_tokens_count", direction="output") == batches
    # Cumulative buckets never decrease.
    buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items()
                      if k[0] == "batchline_engine_batch_seconds_bucket"))
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)

    # Naming conventions: a batchline_ prefix, counters as _total, latency in _seconds.
    ours = {name: kind for name, kind in types.items() if name.startswith("batchline_")}
    assert {n for n, k in ours.items() if k == "counter"} == {
        "batchline_records", "batchline_lease_claims", "batchline_lease_renewals", "batchline_lease_take_backs",
        "batchline_stale_epoch_refusals", "batchline_engine_failures", "batchline_engine_tokens",
        "batchline_cross_region_read_bytes"}
    assert all(name.endswith("_total") for (name, _l) in samples
               if types.get(name.removesuffix("_total")) == "counter" and name.startswith("batchline_"))
    assert ours["batchline_engine_batch_seconds"] == "histogram"
    assert ours["batchline_records_in_flight"] == "gauge"
    assert all(not n.startswith("batchline_") for n in types if n not in ours)
    assert "process_cpu_seconds" in types


def test_tokens_on_a_clean_run_equal_the_stored_tokens(job_factory: Any, store: Store, store_url: str,
                                                       telemetry: tuple[PrometheusTelemetry, int]) -> None:
    t, port = telemetry
    _spec, version = planned(job_factory(n=60), store)
    worker_store = open_store(store_url)
    try:
        assert Worker(worker_store, version=version, worker_id=WORKER, poll_seconds=0.1, telemetry=t).run() == 0
    finally:
        worker_store.close()
    _text, samples, _types = scrape(port)
    tokens_in, tokens_out = store.token_totals(version)
    assert value(samples, "batchline_engine_tokens_total", direction="input") == tokens_in > 0
    assert value(samples, "batchline_engine_tokens_total", direction="output") == tokens_out > 0
    assert value(samples, "batchline_engine_batch_tokens_sum", direction="output") == tokens_out
    assert value(samples, "batchline_engine_batch_records_sum") == 60


def test_a_lease_taken_over_shows_as_stale_epoch_refusals(job_factory: Any, store: Store, store_url: str,
                                                          telemetry: tuple[PrometheusTelemetry, int]) -> None:
    t, port = telemetry
    spec = job_factory(n=160, options={"seconds_per_record": 0.01}, shards={"size": 80, "lease_seconds": 30})
    _spec, version = planned(spec, store)
    worker_store = open_store(store_url)
    worker = Worker(worker_store, version=version, worker_id=WORKER, poll_seconds=0.1, telemetry=t)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: any(r.state == "leased" and 0 < r.results < r.record_count - 20
                             for r in store.shard_rows(version)), what="a shard partly done")
        # Scraped while the worker is busy: the endpoint never waits on the claim loop.
        _text, busy, _types = scrape(port)
        assert value(busy, "batchline_lease_claims_total") == 1
        # The supervisor tops up to two batches in flight, so fewer than three batches of 4.
        assert 0 <= value(busy, "batchline_records_in_flight") < 12
        # Another owner takes the shard over once its lease has run out (on the database's clock).
        store.shift_clock(31)
        thief = store.claim("thief:1:aaaaaa", version)
        assert thief is not None and thief.shard_no == 0
        wait_for(lambda: value(scrape(port)[1], "batchline_stale_epoch_refusals_total", op="put")
                 + value(scrape(port)[1], "batchline_stale_epoch_refusals_total", op="renew") >= 1,
                 what="the worker's write or renewal to be refused")
        store.release(thief, "test")  # the worker finishes the shard later, under a new epoch
        thread.join(timeout=60)
        assert codes == [0]
    finally:
        worker.stop.set()
        thread.join(timeout=30)
        worker_store.close()
    _text, samples, _types = scrape(port)
    refused = [e for e in store.events(version, ["stale_epoch"]) if e.worker == WORKER]
    total = sum(v for (name, _l), v in samples.items() if name == "batchline_stale_epoch_refusals_total")
    assert total == len(refused) >= 1
    mine = [e for e in store.events(version, ["claim"]) if e.worker == WORKER]
    assert value(samples, "batchline_lease_claims_total") == len(mine) == 3
    lost = value(samples, "batchline_lease_renewals_total", result="lost")
    assert lost == sum(1 for e in refused if e.detail.get("op") == "renew")


def test_a_port_in_use_is_one_readable_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BatchlineError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            PrometheusTelemetry().serve(port, "127.0.0.1")
