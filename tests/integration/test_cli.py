"""The command-line contract: exit statuses, one-line errors, JSON that parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchline.store import Store
from tests.helpers import planned, run_to_seal, wait_for


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
    assert status["shards"]["done"] == 3 + status["splits"]  # a slow tail may have been split off
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
    assert all(r["acl"] == source[r["id"]] for r in table)

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


def test_errors_are_one_line_on_stderr_with_a_non_zero_exit(job_factory: Any, store_url: str, store: Store,
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


def test_run_exits_5_with_one_line_when_its_workers_engine_cannot_load(job_factory: Any, store_url: str) -> None:
    # Regression: `run` exited 1 with "worker 0 failed: batchline: error: ..." where the
    # worker itself exits 5: the run now passes on its workers' meaning, in one line.
    run = cli("run", str(job_factory(n=20, options={"fail_load": True})), "--store", store_url, "--workers", "2")
    assert run.returncode == 5
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("batchline: error: worker ") and line.count("batchline: error:") == 1
    assert "synthetic engine told to fail while loading" in line


def test_run_exits_3_when_its_input_changes_under_its_workers(job_factory: Any, store_url: str, store: Store,
                                                              tmp_path: Path) -> None:
    spec_path = job_factory(n=400, options={"seconds_per_record": 0.01}, shards={"size": 50})
    _spec, version = planned(spec_path, store)
    run = subprocess.Popen([sys.executable, "-m", "batchline", "run", str(spec_path), "--store", store_url,
                            "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: store.status(version).results >= 10, what="the run under way")
    data = Path(spec_path.parent / "input.jsonl")
    lines = data.read_text().splitlines(keepends=True)
    lines[-1] = lines[-1].replace("record number", "record NUMBER")
    data.write_text("".join(lines))
    _out, err = run.communicate(timeout=120)
    assert run.returncode == 3, err
    line = err.strip().splitlines()[-1]
    assert line.count("batchline: error:") == 1 and "input changed since planning" in line


def test_an_unfinished_version_is_exported_only_when_asked_for(job_factory: Any, store_url: str, store: Store,
                                                               tmp_path: Path) -> None:
    # Regression: jsonl and parquet exports of an unsealed version wrote the half job and exited 0.
    _spec, version = planned(job_factory(n=20), store)
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"half.{fmt}"
        refused = cli("export", version, "--store", store_url, "--format", fmt, "--out", str(out))
        assert refused.returncode == 1 and "is not finished (0 of 20 records have an outcome)" in refused.stderr
        assert not out.exists()
        assert cli("export", version, "--store", store_url, "--format", fmt, "--out", str(out),
                   "--partial").returncode == 0


def test_read_commands_never_make_a_store(tmp_path: Path) -> None:
    # Regression: `status` in an empty folder made batchline.db, and a mistyped path made
    # its folders and a new store: a typo looked like "every job is gone".
    here = cli("status", cwd=tmp_path)
    assert here.returncode == 4 and "batchline.db does not exist" in here.stderr
    assert not (tmp_path / "batchline.db").exists()
    typo = tmp_path / "no" / "such" / "x.db"
    for command in (["status"], ["dead-letters", "v@1"], ["export", "v@1"], ["validate", "v@1"],
                    ["worker", "--store-wait", "0"]):
        done = cli(*command, "--store", f"sqlite:///{typo}")
        assert done.returncode == 4 and f"{typo} does not exist" in done.stderr, (command, done.stderr)
    assert not (tmp_path / "no").exists()


def test_rates_count_only_this_runs_work_over_the_time_it_took(job_factory: Any, store_url: str,
                                                               store: Store) -> None:
    # Regression: a rerun with nothing to do reported "2,037.71 records/s this run", and
    # `status --json` divided a short run's records by a 300 s window (9.97/s for ~595/s).
    spec = job_factory(n=300, shards={"size": 50})
    first = cli("run", str(spec), "--store", store_url, "--workers", "2")
    assert first.returncode == 0, first.stderr
    assert "300 records answered this run" in first.stderr
    again = cli("run", str(spec), "--store", store_url)
    assert again.returncode == 0 and "nothing was left to answer" in again.stderr
    status = json.loads(cli("status", first.stdout.strip(), "--store", store_url, "--json").stdout)
    assert status["rate_window_seconds"] < 100  # the time since the first claim, not 300 s
    assert status["records_per_second"] > 300 / 100


def test_plan_on_a_mistyped_sqlite_path_says_it_created_a_new_store(job_factory: Any, store: Store,
                                                                    store_url: str, tmp_path: Path) -> None:
    spec = job_factory(n=5)
    typo = tmp_path / "stors" / "batchline.db"
    first = cli("plan", str(spec), "--store", f"sqlite:///{typo}")
    assert first.returncode == 0, first.stderr
    assert [line for line in first.stderr.splitlines() if "store" in line] == [f"created a new store at {typo}"]
    again = cli("plan", str(spec), "--store", f"sqlite:///{typo}")
    assert again.returncode == 0 and "created" not in again.stderr, again.stderr
    existing = cli("plan", str(spec), "--store", store_url)
    assert existing.returncode == 0 and "created a new store" not in existing.stderr, existing.stderr


def test_an_export_or_manifests_to_an_existing_folder_say_so_in_one_line(job_factory: Any, store: Store,
                                                                         store_url: str, tmp_path: Path) -> None:
    _spec, version = planned(job_factory(n=20), store)
    run_to_seal(store, version)
    folder = tmp_path / "exports"
    folder.mkdir()
    for args in (["export", version, "--store", store_url, "--format", "parquet", "--out", str(folder)],
                 ["export", version, "--store", store_url, "--out", str(folder)],
                 ["export", version, "--store", store_url, "--format", "openai-batch", "--out", str(folder)],
                 ["launch", "k8s", "--job", version, "--image", "i", "--queue", "q", "--store-secret", "s", "--egress-cidr", "10.20.0.0/16",
                  "--gpus-per-worker", "0", "--out", str(folder)]):
        done = cli(*args)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        [line] = done.stderr.splitlines()
        assert line.startswith(f"batchline: error: --out {folder} is a folder"), line
    assert list(folder.iterdir()) == []


PASSWORD = "s3cr3t-pw"


def with_password(store_url: str) -> str:
    """The store's URL as a deployment writes it, password and all (the test server's trust
    authentication takes any password)."""
    return store_url.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@")


def test_a_missing_version_exits_66_and_its_message_showed_the_store_password(
        store_url: str, store: Store, tmp_path: Path) -> None:
    """Every command given a version the store does not have exits 66 with one line naming
    the store as `where()` does. Validate, export, publish and the report once wrote the
    store's URL into that line, a PostgreSQL password with it, and exited 1."""
    url = with_password(store_url)
    missing = "nope@123"
    commands = [
        ["status", missing], ["dead-letters", missing], ["validate", missing], ["publish", missing],
        ["export", missing, "--out", str(tmp_path / "out.jsonl")],
        ["export", missing, "--format", "parquet", "--out", str(tmp_path / "out.parquet")],
        ["report", missing, "--html", str(tmp_path / "report.html")],
        ["cancel", missing], ["delete", missing], ["resume", missing],
        ["worker", "--job", missing], ["drill", "--check", missing], ["capacity", "--from-run", missing],
    ]
    if url.startswith("postgresql://"):
        commands.append(["grants", missing, "--dry-run"])
    for args in commands:
        done = cli(*args, "--store", url)
        said = done.stderr.strip()
        assert done.returncode == 66, (args, done.returncode, said)
        assert said.count("\n") == 0 and said.startswith("batchline: error: no job version"), (args, said)
        assert f"'{missing}' in {store.where()}" in said, (args, said)
        assert PASSWORD not in done.stdout + done.stderr, args
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "report.html").exists()


def test_the_rate_of_a_sealed_version_is_over_its_own_run_not_the_time_since(
        job_factory: Any, store_url: str, store: Store) -> None:
    # Regression: status divided a sealed version's outcomes by a window that kept moving on after
    # the seal, so records_per_second fell the longer one waited to look.
    _spec, version = planned(job_factory(n=60), store)
    run_to_seal(store, version)

    def rate() -> tuple[float, float]:
        status = json.loads(cli("status", version, "--store", store_url, "--json").stdout)
        return status["records_per_second"], status["rate_window_seconds"]

    before = rate()
    assert before[0] > 0
    store.shift_clock(3600)
    assert rate() == before


def test_a_published_name_exported_to_a_parquet_file_writes_that_file(
        job_factory: Any, store_url: str, store: Store, tmp_path: Path) -> None:
    from batchline.check.validate import validate
    from batchline.publish.pointer import publish

    _spec, version = planned(job_factory(n=8, name="tickets"), store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    publish(store, version)
    done = cli("export", "tickets", "--format", "parquet", "--out", str(tmp_path / "x.parquet"), "--store", store_url)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.parquet").is_file() and f"of {version} to {tmp_path / 'x.parquet'}" in done.stderr
    assert sorted(r["id"] for r in pq.read_table(tmp_path / "x.parquet").to_pylist()) == [f"r{i:06d}" for i in range(8)]


def test_a_retried_plan_planned_a_new_version_after_its_input_moved(job_factory: Any, store_url: str,
                                                                    store: Store) -> None:
    """`plan --plan-key` (and Jobs.plan(plan_key=...)) as `run` takes it: the retry of a scheduled
    plan, after a record was added to its input, returns the version the key was planned as."""
    import yaml

    from batchline.api import Jobs

    spec = job_factory(n=20)
    key = "2026-12-06T02:00"
    first = cli("plan", str(spec), "--store", store_url, "--plan-key", key)
    assert first.returncode == 0, first.stderr
    version = first.stdout.strip()
    data = Path(yaml.safe_load(spec.read_text())["input"]["path"])
    data.write_text(data.read_text() + json.dumps({"id": "late", "text": "a ticket filed after the plan",
                                                               "acl": ["g"]}) + "\n")
    again = Jobs(store_url).plan(spec, plan_key=key, log=lambda _m: None)
    assert (again.version, again.created, again.records) == (version, False, 20)
    retried = cli("plan", str(spec), "--store", store_url, "--plan-key", key)
    assert retried.stdout.strip() == version and f"run {key!r} of test-job was planned as {version}" in retried.stderr
    fresh = Jobs(store_url).plan(spec, log=lambda _m: None)
    assert fresh.version != version and fresh.records == 21 and fresh.created
    refused = cli("plan", str(spec), "--store", store_url, "--plan-key", key, "--dry-run")
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1
    assert "--plan-key keys the version planned and --dry-run writes nothing" in refused.stderr
