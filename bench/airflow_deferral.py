"""A deferred batchline task holds no Airflow worker slot: measured on a real Airflow (its API
server, scheduler, DAG processor and triggerer as separate processes, the LocalExecutor with
one slot, PostgreSQL as its metadata database), not `dag.test()`.

    python bench/airflow_deferral.py [--records 3000 --seconds-per-record 0.1]

The DAG is one `BatchlineRunOperator` (local launcher, one worker, the synthetic engine: about
`records x seconds-per-record` seconds of work, five minutes by default). The bench samples the
task instance's state from Airflow's metadata database every 0.2 s and reports the time it was
`running` on a worker before it deferred and after the trigger fired (each to within a sample),
the time it was deferred, and the fleet's own time (the version's run start to its seal, from
batchline's store). While the task is deferred it triggers a second DAG, a one-second task: with
`parallelism = 1`, that task can run only if the batchline task holds no slot. Wall-clock on this
machine (2 cores shared by Airflow's four processes, the runner and its worker), one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

BATCH_DAG = '''
import datetime
from airflow.sdk import DAG
from batchline.orchestrators.airflow.operators import BatchlineRunOperator
with DAG("bench_batchline", schedule=None, start_date=datetime.datetime(2026, 1, 1), catchup=False) as dag:
    BatchlineRunOperator(task_id="run", spec={spec!r}, workers=1, poll_seconds=5)
'''
CANARY_DAG = '''
import datetime, time
from airflow.sdk import DAG
from airflow.providers.standard.operators.python import PythonOperator
with DAG("bench_canary", schedule=None, start_date=datetime.datetime(2026, 1, 1), catchup=False) as dag:
    PythonOperator(task_id="sleep", python_callable=lambda: time.sleep(1))
'''


def write_job(folder: Path, records: int, seconds: float) -> Path:
    import yaml

    folder.mkdir(parents=True)
    with (folder / "input.jsonl").open("w") as f:
        for i in range(records):
            f.write(json.dumps({"id": f"r{i:06d}", "text": f"ticket {i}: the printer on floor {i % 7} jams"}) + "\n")
    (folder / "schema.json").write_text(json.dumps({
        "type": "object", "properties": {"category": {"enum": ["a", "b", "c"]},
                                         "summary": {"type": "string", "maxLength": 40}},
        "required": ["category", "summary"], "additionalProperties": False}))
    spec = {"name": "bench-deferral", "input": {"path": "input.jsonl", "id_field": "id"},
            "model": {"engine": "synthetic", "options": {"seconds_per_record": seconds}},
            "prompt": {"text": "Classify.\n", "version": "v1"}, "output": {"schema": "schema.json"},
            "shards": {"size": 250, "lease_seconds": 120, "renew_seconds": 10, "batch_size": 8}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    return folder / "job.yaml"


def states(conn: Any, dag_id: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT state FROM task_instance WHERE dag_id = %s", (dag_id,)).fetchall()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--seconds-per-record", type=float, default=0.1)
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres",
                        help="a PostgreSQL server where the bench may make the database afbench")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "airflow_deferral.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="afbench-"))
    spec = write_job(work / "job", args.records, args.seconds_per_record)
    store = f"sqlite:///{work / 'store.db'}"
    from batchline.store import open_store

    open_store(store).close()  # a connection never makes a store: the user's first `batchline plan` does
    dags = work / "dags"
    dags.mkdir()
    (dags / "bench_batchline.py").write_text(BATCH_DAG.format(spec=str(spec)))
    (dags / "bench_canary.py").write_text(CANARY_DAG)
    with psycopg.connect(args.pg, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS afbench WITH (FORCE)")
        admin.execute("CREATE DATABASE afbench")
    base = args.pg.rsplit("/", 1)[0].replace("postgresql://", "")
    with socket.socket() as probe:  # a port of its own: 8793 is Airflow's own log server's
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(work / "airflow"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql+psycopg://{base}/afbench",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": f"postgresql+psycopg_async://{base}/afbench",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor", "AIRFLOW__CORE__PARALLELISM": "1",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        "AIRFLOW__API_AUTH__JWT_SECRET": "bench-" + os.urandom(16).hex(),
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "1", "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
        "AIRFLOW_CONN_BATCHLINE_DEFAULT": json.dumps({"conn_type": "batchline", "extra": {
            "store": store, "local": {"runner_dir": str(work / "runners")}}}),
        "PYTHONPATH": str(ROOT),
    })
    airflow = str(VENV_BIN / "airflow")
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True)
    procs = [subprocess.Popen([airflow, part], env=env, stdout=(work / f"{part}.log").open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
             for part in ("api-server", "scheduler", "dag-processor", "triggerer")]
    meta = psycopg.connect(f"postgresql://{base}/afbench", autocommit=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                # Any answer (401 without a token included) says the API server is up.
                with contextlib.suppress(urllib.error.HTTPError):
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/version", timeout=2).close()
                parsed = {r[0] for r in meta.execute("SELECT dag_id FROM dag").fetchall()}
                if {"bench_batchline", "bench_canary"} <= parsed:
                    break
            except (OSError, psycopg.Error):
                pass
            time.sleep(1)
        else:
            raise SystemExit(f"Airflow did not come up; its logs are in {work}")
        subprocess.run([airflow, "dags", "trigger", "bench_batchline"], env=env, check=True, capture_output=True)
        started = time.monotonic()
        samples: list[tuple[float, str | None, str | None]] = []
        canary_triggered = None
        while True:
            batch = states(meta, "bench_batchline")
            canary = states(meta, "bench_canary")
            now = time.monotonic() - started
            samples.append((now, batch[0] if batch else None, canary[0] if canary else None))
            if canary_triggered is None and batch and batch[0] == "deferred":
                subprocess.run([airflow, "dags", "trigger", "bench_canary"], env=env, check=True, capture_output=True)
                canary_triggered = time.monotonic() - started
            if batch and batch[0] in ("success", "failed", "up_for_retry"):
                break
            if now > 3600:
                raise SystemExit("the batchline task did not end within an hour")
            time.sleep(0.2)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        meta.close()

    def spans(column: int, state: str) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        begin = None
        for t, *cols in samples:
            on = cols[column] == state
            if on and begin is None:
                begin = t
            if not on and begin is not None:
                out.append((begin, t))
                begin = None
        if begin is not None:
            out.append((begin, samples[-1][0]))
        return out

    running = spans(0, "running")
    deferred = spans(0, "deferred")
    canary_running = spans(1, "running")
    final = samples[-1][1]
    from batchline.store import open_store

    s = open_store(store, create=False)
    try:
        [job] = s.jobs()
        status = s.status(job.version)
        fleet = (job.sealed_at or 0.0) - (status.run_start or 0.0)
    finally:
        s.close()
    result = {
        "date": time.strftime("%Y-%m-%d"), "records": args.records, "seconds_per_record": args.seconds_per_record,
        "task_state": final, "running_spans_s": [[round(a, 1), round(b, 1)] for a, b in running],
        "before_deferral_s": round(running[0][1] - running[0][0], 1) if running else None,
        "after_trigger_s": round(running[-1][1] - running[-1][0], 1) if len(running) > 1 else None,
        "deferred_s": round(sum(b - a for a, b in deferred), 1), "fleet_s": round(fleet, 1),
        "canary_triggered_at_s": round(canary_triggered, 1) if canary_triggered is not None else None,
        "canary_running_s": [[round(a, 1), round(b, 1)] for a, b in canary_running],
        "canary_ran_while_deferred": any(d0 <= c0 and c1 <= d1 for c0, c1 in canary_running for d0, d1 in deferred),
        "logs": str(work),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"task {final}; on a worker {result['before_deferral_s']} s before deferring and "
          f"{result['after_trigger_s']} s after the trigger fired; deferred {result['deferred_s']} s "
          f"(the fleet's work: {result['fleet_s']} s)")
    print(f"the one-slot executor ran another DAG's task while it was deferred: {result['canary_ran_while_deferred']} "
          f"(running at {result['canary_running_s']} s)")
    print(f"states sampled every 0.2 s from Airflow's metadata database; figures in {args.out}")
    return 0 if final == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
