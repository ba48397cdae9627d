"""The command-line contract: exit statuses, one-line errors, JSON that parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchline.store import Store


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchline", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_run_then_status_dead_letters_and_exports(job_factory: Any, store_url: str, store: Store,
                                                   tmp_path: Path) -> None:
    spec = job_factory(n=150, options={"error_on": ["r000010"]})
    run = cli("run", str(spec), "--store", store_url, "--workers", "2")
    assert run.returncode == 0, run.stderr
    version = run.stdout.strip()
    assert "sealed" in run.stderr and "dead letters 1 (engine_error 1)" in run.stderr

    status = json.loads(cli("status", version, "--store", store_url, "--json").stdout)
    assert status["state"] == "sealed"
    assert status["shards"]["done"] == 3
    assert status["outcomes"] == {"results": 149, "dead_letters": 1, "pending": 0}
    assert status["dead_letters_by_kind"] == {"engine_error": 1}

    letters = json.loads(cli("dead-letters", version, "--store", store_url, "--json").stdout)
    assert [(d["id"], d["kind"], d["attempts"], d["acl"]) for d in letters] == [
        ("r000010", "engine_error", 3, ["group-1"])]

    out = tmp_path / "out.jsonl"
    assert cli("export", version, "--store", store_url, "--out", str(out)).returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 149
    source = {f"r{i:06d}": [f"group-{i % 3}"] for i in range(150)}
    assert all(r["acl"] == source[r["id"]] for r in rows)

    pq_out = tmp_path / "out.parquet"
    assert cli("export", version, "--store", store_url, "--format", "parquet", "--out", str(pq_out)).returncode == 0
    table = pq.read_table(pq_out).to_pylist()
    assert len(table) == 149
    assert all(json.loads(r["acl"]) == source[r["id"]] for r in table)

    again = cli("run", str(spec), "--store", store_url)
    assert again.returncode == 0 and again.stdout.strip() == version


def test_plan_prints_the_version_and_status_lists_jobs(job_factory: Any, store_url: str) -> None:
    spec = job_factory(n=20)
    planned = cli("plan", str(spec), "--store", store_url)
    assert planned.returncode == 0
    version = planned.stdout.strip()
    listing = cli("status", "--store", store_url)
    assert version in listing.stdout and "ready" in listing.stdout
    assert cli("plan", str(spec), "--store", store_url).stdout.strip() == version


def test_errors_are_one_line_on_stderr_with_a_non_zero_exit(job_factory: Any, store_url: str,
                                                          tmp_path: Path) -> None:
    missing = cli("status", "nope@123", "--store", store_url)
    assert missing.returncode != 0
    assert missing.stderr.strip().count("\n") == 0
    assert "no job version or published name 'nope@123'" in missing.stderr

    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text("name: x\n")
    result = cli("plan", str(bad_spec), "--store", store_url)
    assert result.returncode == 2
    assert result.stderr.strip() == f"batchline: error: {bad_spec}: input: is required"

    bad_input = tmp_path / "bad.jsonl"
    bad_input.write_bytes(b'{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    result = cli("plan", str(job_factory(input_path=bad_input)), "--store", store_url)
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == (
        f"batchline: error: {bad_input}:2: duplicate id 'a' (first at {bad_input}:1)")

    assert cli("status", "--store", "mysql://x").returncode == 4
