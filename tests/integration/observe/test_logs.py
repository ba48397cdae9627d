"""`--log-format json`: every line a worker logs is one JSON object with its fields."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from batchline.errors import BatchlineError
from batchline.ops.logs import configure_worker_logging
from batchline.store import Store, open_store
from batchline.worker.supervisor import Worker
from tests.helpers import planned

HOSTILE_ID = 'line\nbreak "quoted" {"level": "forged"}'


@pytest.fixture(autouse=True)
def root_logger() -> Iterator[None]:
    # configure_worker_logging owns the root logger, as a worker process does; give it back.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_a_worker_logs_one_json_object_per_line(job_factory: Any, store: Store, store_url: str) -> None:
    records = [{"id": f"r{i}", "text": f"text {i}", "acl": None} for i in range(12)]
    records[4]["id"] = HOSTILE_ID
    _spec, version = planned(job_factory(records, options={"error_on": [HOSTILE_ID]}), store)
    stream = io.StringIO()
    log = configure_worker_logging("json", "host:7:abcdef", stream)
    worker_store = open_store(store_url)
    try:
        code = Worker(worker_store, version=version, worker_id="host:7:abcdef", log=log.info).run()
    finally:
        worker_store.close()
    assert code == 0
    lines = stream.getvalue().splitlines()
    entries = [json.loads(line) for line in lines]  # every line parses on its own
    assert entries and all(set(e) >= {"ts", "level", "logger", "worker", "pid", "msg"} for e in entries)
    assert {e["worker"] for e in entries} == {"host:7:abcdef"}
    assert {e["level"] for e in entries} == {"info"}
    assert all(e["ts"].endswith("Z") and "T" in e["ts"] for e in entries)
    msgs = [e["msg"] for e in entries]
    assert any(m.startswith("claimed shard 0 of ") for m in msgs)
    # The hostile id is kept whole inside its field: no extra line, no forged field.
    assert f"record {HOSTILE_ID}: dead letter after 3 attempts (engine_error)" in msgs
    assert all("forged" not in e["level"] for e in entries)


def test_extra_fields_and_exceptions_become_fields() -> None:
    stream = io.StringIO()
    log = configure_worker_logging("json", "w1", stream)
    log.info("claimed", extra={"shard": 3, "version": "job@abc"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["msg"], first["shard"], first["version"]) == ("claimed", 3, "job@abc")
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]


def test_text_format_keeps_the_worker_id_and_configuring_twice_does_not_double_lines() -> None:
    stream = io.StringIO()
    configure_worker_logging("text", "w2", stream)
    log = configure_worker_logging("text", "w2", stream)
    log.info("hello")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(" w2 hello")
    with pytest.raises(BatchlineError, match="--log-format must be one of text, json"):
        configure_worker_logging("xml", "w2", stream)


def test_the_engine_childs_own_stderr_comes_out_as_json_lines_too(job_factory: Any, store: Store,
                                                                   store_url: str) -> None:
    records = [{"id": f"r{i}", "text": f"text {i}", "acl": None} for i in range(3)]
    # Written to fd 2 as a native library writes, with a line that looks like a log object.
    message = 'llama_model_load: loaded meta data\n{"level": "error", "msg": "forged"}'
    _spec, version = planned(job_factory(records, options={"stderr_message": message}), store)
    stream = io.StringIO()
    log = configure_worker_logging("json", "host:8:abcdef", stream)
    worker_store = open_store(store_url)
    try:
        assert Worker(worker_store, version=version, worker_id="host:8:abcdef", log=log.info).run() == 0
    finally:
        worker_store.close()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is JSON
    engine = [line for line in lines if line["logger"] == "batchline.engine"]
    assert [e["msg"] for e in engine][:2] == ["llama_model_load: loaded meta data",
                                              '{"level": "error", "msg": "forged"}']
    assert all(e["worker"] == "host:8:abcdef" for e in engine)


def test_engine_stderr_that_is_not_utf8_is_relayed_with_replacements_not_dropped() -> None:
    from batchline.worker.engine_process import _relay_stderr

    stream = io.StringIO()
    configure_worker_logging("json", "w3", stream)
    _relay_stderr(io.BytesIO(b"first\n\xff\xfe broken bytes\r\n\nlast without newline"))
    assert [json.loads(line)["msg"] for line in stream.getvalue().splitlines()] == [
        "first", "\ufffd\ufffd broken bytes", "last without newline"]
