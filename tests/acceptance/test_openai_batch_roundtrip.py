"""An OpenAI batch file in, OpenAI's output and error files out: one line per input line,
in the input's order, through a real `batchline run`, a worker killed mid-run and a resume."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from batchline.engines.base import plain_chat_prompt
from batchline.ops.drill.run import children, gone
from batchline.store import Store
from tests.helpers import (
    SIMPLE_SCHEMA,
    call_counts,
    make_records,
    planned,
    start_worker,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.acceptance


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def chat_lines(n: int) -> list[dict[str, Any]]:
    """Requests whose custom_ids are not in sorted order (the store keeps results by id),
    some of them multi-turn, some with content parts."""
    lines = []
    for i in range(n):
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Sort the ticket into a, b or c."}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": f"earlier ticket {i}"}, {"role": "assistant", "content": "a"}]
        user: Any = f"ticket {i}: printer {i % 5} jammed"
        if i % 4 == 0:
            user = [{"type": "text", "text": f"ticket {i}:"}, {"type": "text", "text": f"printer {i % 5} jammed"}]
        messages.append({"role": "user", "content": user})
        lines.append({"custom_id": f"req-{(i * 7919) % 1000:03d}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "gpt-4o-mini", "messages": messages, "max_tokens": 64, "temperature": 0}})
    return lines


def write_job(tmp_path: Path, lines: list[dict[str, Any]], options: dict[str, Any],
              shards: dict[str, Any] | None = None) -> Path:
    data = tmp_path / "requests.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    spec = {
        "name": "chat-batch",
        "input": {"path": str(data), "format": "openai-batch"},
        "model": {"engine": "synthetic", "options": options},
        "decoding": {"temperature": 0, "max_tokens": 64},
        "output": {"schema": SIMPLE_SCHEMA},
        "shards": {"size": 8, "lease_seconds": 30, "renew_seconds": 1, "batch_size": 4,
                   "record_timeout_seconds": 2.0, "batch_timeout_seconds": 2.0, "grace_seconds": 5,
                   **(shards or {})},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def export(store_url: str, version: str, out: Path, *extra: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    done = cli("export", version, "--store", store_url, "--format", "openai-batch", "--out", out, *extra)
    assert done.returncode == 0, done.stderr
    return read_jsonl(out), read_jsonl(out.with_name(out.name.replace(".jsonl", ".errors.jsonl")))


def assert_one_line_per_input(lines: list[dict[str, Any]], outputs: list[dict[str, Any]],
                              errors: list[dict[str, Any]]) -> None:
    wanted = [line["custom_id"] for line in lines]
    answered = [o["custom_id"] for o in outputs]
    failed = [e["custom_id"] for e in errors]
    assert len(answered) == len(set(answered)) and len(failed) == len(set(failed)), "a custom_id came out twice"
    assert not set(answered) & set(failed)
    assert sorted(answered + failed) == sorted(wanted)
    # Each file keeps the input's order.
    assert answered == [c for c in wanted if c in set(answered)]
    assert failed == [c for c in wanted if c in set(failed)]


def test_round_trip_gives_openai_output_and_error_files_in_input_order(tmp_path: Path, store_url: str) -> None:
    lines = chat_lines(30)
    poison = lines[4]["custom_id"]
    job = write_job(tmp_path, lines, {"error_on": [poison]})
    run = cli("run", job, "--store", store_url, "--workers", "2")
    assert run.returncode == 0, run.stderr
    version = run.stdout.strip()

    out = tmp_path / "exports" / "results.jsonl"
    outputs, errors = export(store_url, version, out)
    assert_one_line_per_input(lines, outputs, errors)
    assert [e["custom_id"] for e in errors] == [poison]

    by_id = {line["custom_id"]: line for line in lines}
    for o in outputs:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        response = o["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        body = response["body"]
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["model"] and isinstance(body["created"], int)
        [choice] = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "stop" and choice["logprobs"] is None
        assert choice["message"]["role"] == "assistant"
        content = json.loads(choice["message"]["content"])
        jsonschema.validate(content, SIMPLE_SCHEMA)
        # The engine saw the conversation: its text is the last user turn, and its prompt
        # (the synthetic engine counts a token per 4 characters) is the whole conversation.
        messages = by_id[o["custom_id"]]["body"]["messages"]
        last = messages[-1]["content"]
        last_text = last if isinstance(last, str) else "\n".join(p["text"] for p in last)
        assert content["summary"] == " ".join(last_text.split())[:30]
        normalised = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                       else "\n".join(p["text"] for p in m["content"])} for m in messages]
        usage = body["usage"]
        assert usage["prompt_tokens"] == math.ceil(len(plain_chat_prompt(normalised)) / 4)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    [error] = errors
    assert error["response"] is None and error["id"].startswith("batch_req_")
    assert error["error"]["code"] == "engine_error" and "synthetic engine error" in error["error"]["message"]

    # Exporting again writes the same bytes: ids are stable, not drawn at random.
    first = (out.read_bytes(), out.with_name("results.errors.jsonl").read_bytes())
    again = tmp_path / "again" / "results.jsonl"
    export(store_url, version, again)
    assert (again.read_bytes(), again.with_name("results.errors.jsonl").read_bytes()) == first


def test_an_unfinished_version_is_refused_unless_partial(tmp_path: Path, store_url: str) -> None:
    lines = chat_lines(10)
    version = cli("plan", write_job(tmp_path, lines, {}), "--store", store_url).stdout.strip()
    out = tmp_path / "results.jsonl"
    refused = cli("export", version, "--store", store_url, "--format", "openai-batch", "--out", out)
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0
    assert f"{version} is not finished (0 of 10 records have an outcome)" in refused.stderr
    assert "--partial" in refused.stderr and not out.exists()

    outputs, errors = export(store_url, version, out, "--partial", "--errors", str(tmp_path / "results.errors.jsonl"))
    assert outputs == [] and errors == []


def test_any_job_exports_in_its_input_order_with_record_ids_as_custom_ids(
        job_factory: Any, store_url: str, tmp_path: Path) -> None:
    records = make_records(60)
    random.Random(7).shuffle(records)
    run = cli("run", job_factory(records), "--store", store_url)
    assert run.returncode == 0, run.stderr
    outputs, errors = export(store_url, run.stdout.strip(), tmp_path / "plain.jsonl")
    assert [o["custom_id"] for o in outputs] == [r["id"] for r in records] and errors == []
    assert all(o["response"]["body"]["model"] == "synthetic" for o in outputs)


def test_a_worker_killed_mid_run_then_resumed_exports_each_line_once(
        tmp_path: Path, store: Store, store_url: str) -> None:
    lines = chat_lines(120)
    call_log = tmp_path / "calls.log"
    job = write_job(tmp_path, lines, {"seconds_per_record": 0.03, "call_log": str(call_log)},
                    shards={"size": 20})
    _spec, version = planned(job, store)
    worker = start_worker(store_url, version, tmp_path / "victim.log")

    def mid_shard() -> bool:
        # Killed while it holds a lease with records still to do (not in the gap between two
        # shards), so the next run must take the shard over when the lease expires.
        return 10 <= store.status(version).results <= 100 and any(
            r.state == "leased" and 1 <= r.results <= r.record_count - 8 for r in store.shard_rows(version))

    try:
        wait_for(mid_shard, what="the worker partly through the job, in the middle of a shard")
        engine_children = children(worker.pid)
        os.kill(worker.pid, signal.SIGKILL)
        wait_for(lambda: gone(worker.pid) and all(gone(c) for c in engine_children), what="the worker gone")
    finally:
        stop_all([worker])
    at_kill = store.status(version)
    assert 10 <= at_kill.results < 120 and at_kill.state != "sealed"
    # The killed worker's lease would expire by itself; shift the database clock instead of waiting.
    store.shift_clock(31)

    again = cli("run", job, "--store", store_url, "--workers", "2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == version
    assert store.events(version, ["lease_expired"]), "the killed worker's lease never expired"
    # Some records were computed twice (those in flight at the kill); each still comes out once.
    assert set(call_counts(call_log)) == {line["custom_id"] for line in lines}

    outputs, errors = export(store_url, version, tmp_path / "results.jsonl")
    assert errors == []
    assert_one_line_per_input(lines, outputs, errors)
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines]
