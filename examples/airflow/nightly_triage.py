"""The nightly ticket triage on Airflow: the incremental triage job, then the embedding job
over its summaries, then the index's publish.

Each `BatchlineRunOperator` plans its night's version under the task's key (a retry finds
the same version), launches the fleet once (here `local`: a detached runner on the worker's
machine; `kubernetes` or `ray` for a cluster), and defers: while the fleet works the task
waits on the triggerer and holds no worker slot. The triage task then validates and
publishes; the embedding task only validates, and `publish_index` publishes it (the
LanceDB index readers search) once it has. The store comes from the `batchline_default`
connection (type `batchline`), never from this file:

    AIRFLOW_CONN_BATCHLINE_DEFAULT='{"conn_type": "batchline", "host": "db", "login": "batchline",
                                     "password": "...", "schema": "batchline"}'

The specs are parameters, so a run can name others (`airflow dags trigger -c '{...}'`).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from airflow.sdk import DAG, Param

from batchline.orchestrators.airflow.operators import BatchlinePublishOperator, BatchlineRunOperator

SPECS = Path(__file__).resolve().parents[1] / "nightly"

with DAG(
    "batchline_nightly_triage",
    schedule="0 1 * * *",
    start_date=datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": datetime.timedelta(minutes=5)},
    params={"triage_spec": Param(str(SPECS / "triage.yaml"), type="string"),
            "summaries_spec": Param(str(SPECS / "summaries.yaml"), type="string"),
            # How often the triggerer reads the store while the fleet works.
            "poll_seconds": Param(30, type="number", exclusiveMinimum=0)},
    tags=["batchline"],
) as dag:
    triage = BatchlineRunOperator(task_id="triage", spec="{{ params.triage_spec }}", launcher="local",
                                  workers=2, deadline="6h", publish=True, poll_seconds="{{ params.poll_seconds }}")
    summaries = BatchlineRunOperator(task_id="summaries", spec="{{ params.summaries_spec }}", launcher="local",
                                     workers=1, publish=False, poll_seconds="{{ params.poll_seconds }}")
    publish_index = BatchlinePublishOperator(task_id="publish_index",
                                             version="{{ ti.xcom_pull(task_ids='summaries')['version'] }}")
    triage >> summaries >> publish_index

if __name__ == "__main__":
    dag.test()
