"""Airflow scenarios, each run in a process of its own (Airflow reads its configuration from
the environment when imported, which the test sets: its home, a metadata database made for
the test, the DAGs folder, and the `batchline_default` connection). Each prints one JSON line
last: what the test asserts on.

    python tests/integration/orchestrators/airflow_scenarios.py SCENARIO ARGS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace
from typing import Any


def _context(task_id: str, try_number: int, run_id: str = "scheduled__2026-12-06T01:00:00+00:00") -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="nightly", task_id=task_id, run_id=run_id, map_index=-1, try_number=try_number)
    return {"ti": ti}


def _defer(op: Any, context: dict[str, Any]) -> Any:
    from airflow.sdk.exceptions import TaskDeferred

    try:
        op.execute(context)
    except TaskDeferred as deferred:
        return deferred
    raise AssertionError("the operator did not defer")


async def _fire(trigger: Any) -> dict[str, Any]:
    async for event in trigger.run():
        return dict(event.payload)
    raise AssertionError("the trigger ended without an event")


def example_dag(args: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, args["dags"])
    from nightly_triage import dag  # type: ignore[import-not-found]

    run = dag.test(run_conf={"triage_spec": args["triage"], "summaries_spec": args["summaries"], "poll_seconds": 0.5})
    tasks = {}
    for ti in run.get_task_instances():
        tasks[ti.task_id] = {"state": str(ti.state.value if hasattr(ti.state, "value") else ti.state),
                             "try_number": ti.try_number,
                             "start": ti.start_date.isoformat() if ti.start_date else None,
                             "end": ti.end_date.isoformat() if ti.end_date else None}
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    xcoms: dict[str, Any] = {}
    with create_session() as session:
        for row in session.query(XComModel).filter(XComModel.dag_id == dag.dag_id, XComModel.run_id == run.run_id):
            xcoms.setdefault(row.task_id, {})[row.key] = row.value
    return {"state": str(run.state), "tasks": tasks, "xcoms": xcoms}


def defer_retry_and_finish(args: dict[str, Any]) -> dict[str, Any]:
    from batchline.orchestrators.airflow.operators import BatchlineRunOperator

    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=2, poll_seconds=0.2)
    first = _defer(op, _context("triage", 1))
    trigger = first.trigger
    classpath, kwargs = trigger.serialize()
    # The task is killed while deferred (its trigger never fires), then retried.
    retried = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=2, poll_seconds=0.2)
    second = _defer(retried, _context("triage", 2))
    event = asyncio.run(_fire(second.trigger))
    manifest = retried.execute_complete(_context("triage", 2), event)
    lineage = retried.get_openlineage_facets_on_complete(None)
    return {"classpath": classpath, "kwargs": kwargs, "method": first.method_name,
            "second_kwargs": second.trigger.serialize()[1], "event": event, "manifest": manifest,
            "lineage": {"inputs": [[d.namespace, d.name] for d in lineage.inputs],
                        "outputs": [[d.namespace, d.name, d.facets["version"].datasetVersion]
                                    for d in lineage.outputs],
                        "run_facets": sorted(lineage.run_facets)}}


def killed_then_retried(args: dict[str, Any]) -> dict[str, Any]:
    from batchline.orchestrators.airflow.operators import BatchlineRunOperator

    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=1, poll_seconds=0.2)
    deferred = _defer(op, _context("triage", 1))
    op.on_kill()
    retried = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=1, poll_seconds=0.2)
    again = _defer(retried, _context("triage", 2))
    event = asyncio.run(_fire(again.trigger))
    manifest = retried.execute_complete(_context("triage", 2), event)
    return {"version": deferred.trigger.version, "manifest": manifest}


def killed_while_deferred_then_retried(args: dict[str, Any]) -> dict[str, Any]:
    """A user marks the deferred task failed: Airflow calls the trigger's `on_kill` (from a
    trigger rebuilt from its serialised form, as the triggerer holds it); the next try runs."""
    import importlib

    from batchline.orchestrators.airflow.operators import BatchlineRunOperator

    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=1, poll_seconds=0.2)
    deferred = _defer(op, _context("triage", 1))
    classpath, kwargs = deferred.trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    held = getattr(importlib.import_module(module), name)(**kwargs)
    asyncio.run(held.on_kill())
    import contextlib

    from batchline.orchestrators.airflow.hooks import BatchlineHook
    from batchline.store import open_store

    with contextlib.closing(open_store(BatchlineHook().store_url(), create=False)) as store:
        [record] = store.launches(deferred.trigger.version)
    retried = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=1, poll_seconds=0.2)
    again = _defer(retried, _context("triage", 2))
    event = asyncio.run(_fire(again.trigger))
    manifest = retried.execute_complete(_context("triage", 2), event)
    return {"version": deferred.trigger.version, "kwargs": kwargs, "manifest": manifest,
            "after_kill": [record.state, record.stop_reason]}


def failing_gate(args: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk.exceptions import AirflowException

    from batchline.orchestrators.airflow.operators import BatchlineRunOperator

    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], workers=1, poll_seconds=0.2)
    deferred = _defer(op, _context("triage", 1))
    event = asyncio.run(_fire(deferred.trigger))
    try:
        op.execute_complete(_context("triage", 1), event)
    except AirflowException as exc:
        return {"version": deferred.trigger.version, "event": event, "failed": str(exc)}
    return {"version": deferred.trigger.version, "event": event, "failed": None}


def store_unreachable(args: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk.exceptions import AirflowException

    from batchline.orchestrators.airflow.operators import BatchlineRunOperator
    from batchline.orchestrators.airflow.triggers import BatchlineVersionTrigger

    trigger = BatchlineVersionTrigger(args["version"], "batchline_gone", poll_seconds=0.05, max_failures=3)
    event = asyncio.run(_fire(trigger))
    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], batchline_conn_id="batchline_gone")
    try:
        op.execute_complete(_context("triage", 1), event)
    except AirflowException as exc:
        return {"event": event, "failed": str(exc)}
    return {"event": event, "failed": None}


def refused_at_start(args: dict[str, Any]) -> dict[str, Any]:
    from batchline.orchestrators.airflow.operators import BatchlineRunOperator

    op = BatchlineRunOperator(task_id="triage", spec=args["spec"], **args.get("kwargs", {}))
    try:
        op.execute(_context("triage", 1))
    except Exception as exc:  # what the task's log shows: the scenario reports it
        return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"refused": None}


def provider(args: dict[str, Any]) -> dict[str, Any]:
    import importlib.resources

    import jsonschema
    from airflow.providers_manager import ProvidersManager

    from batchline.orchestrators.airflow import get_provider_info

    schema = json.loads(importlib.resources.files("airflow").joinpath("provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)
    manager = ProvidersManager()
    hook = manager.hooks.get("batchline")
    return {"providers": sorted(p for p in manager.providers if "batchline" in p),
            "hook": hook.hook_class_name if hook else None,
            "triggers": [t.trigger_class_name for t in manager.trigger if "batchline" in t.trigger_class_name]}


SCENARIOS = {f.__name__: f for f in (example_dag, defer_retry_and_finish, killed_then_retried,
                                      killed_while_deferred_then_retried, failing_gate, store_unreachable,
                                      refused_at_start, provider)}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print("\nRESULT " + json.dumps(result, default=str))
