"""`BatchlineRunOperator`: one task runs one job version on the fleet, holding an Airflow
worker only to plan and launch, and again to validate and publish.

`execute` plans the version under the task's key (`airflow:DAG/TASK/RUN/MAP_INDEX`, the
same on every retry, so a retry after the input moved finds the version its first try
planned), refuses a gate whose checks run a model (an Airflow worker has none: run those
with `batchline validate` where the model is), launches the fleet once
(`batchline.launch.fleet.launch_once`: a retry re-attaches), and defers to
`BatchlineVersionTrigger`. `execute_complete` fails the task on a halted or cancelled
version, or on a failed gate (its table in the error; nothing published); else it publishes
(with `publish=True`) and returns a small manifest (its XCom): version, counts, tokens,
where it was published, never results. `on_kill` stops the fleet the task launched (its
workers give their leases back) and records it; a worker or triggerer that crashes leaves
the fleet running, and the retry re-attaches to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from batchline.orchestrators.airflow.hooks import BatchlineHook
from batchline.orchestrators.airflow.triggers import ERROR, BatchlineVersionTrigger


def gate_and_publish(store_url: str, version: str, publish: bool, log: Callable[[str], None],
                     plan_key: str | None = None, over_newer: str | None = None) -> dict[str, Any]:
    """Validates a sealed version and, when it passes and `publish`, publishes it; the
    version's manifest. A failed gate raises with its table: nothing is published. With the
    run's `plan_key`, a name whose pointer moved since the run planned is not moved back
    (the task fails saying so, unless `over_newer` says why it should be)."""
    from batchline.api import Jobs
    from batchline.errors import PointerMovedOn
    from batchline.launch.fleet import manifest
    from batchline.store import open_store

    jobs = Jobs(store_url)
    published_as: str | None = None
    report = jobs.validate(version, log=log)
    log(report.table())
    if not report.passed:
        # The sealed version validates the same on every try: a retry cannot pass it.
        raise AirflowFailException(f"{version} failed its gate; nothing published\n{report.table()}")
    if publish:
        try:
            published_as = jobs.publish(version, plan_key=plan_key, over_newer=over_newer, log=log).name
        except PointerMovedOn as exc:
            raise AirflowFailException(str(exc)) from None  # a retry would find it moved on the same way
    with contextlib.closing(open_store(store_url, create=False)) as store:
        return manifest(store, version, published_as)


def _name_lineage_parent(store: Any, version: str, context: Mapping[str, Any]) -> None:
    """Names the task's OpenLineage run as the version's lineage parent, where Airflow's
    OpenLineage provider is installed: batchline's events then hang under the task's run."""
    try:
        from airflow.providers.openlineage.plugins.macros import (
            lineage_job_name,
            lineage_job_namespace,
            lineage_run_id,
        )
    except ImportError:
        return
    ti = context["ti"]
    try:
        parent = {"namespace": lineage_job_namespace(),  # type: ignore[no-untyped-call]
                  "name": lineage_job_name(ti), "run_id": lineage_run_id(ti)}
    except (AttributeError, KeyError, TypeError):  # a task instance the provider cannot name a run for
        return
    store.set_lineage_parent(version, parent)


def task_key(context: Mapping[str, Any]) -> str:
    """The task run's key: its DAG, task, run and map index, the same on each of its tries."""
    ti = context["ti"]
    return f"airflow:{ti.dag_id}/{ti.task_id}/{ti.run_id}/{ti.map_index}"


class BatchlineRunOperator(BaseOperator):
    """Runs the job of `spec` on the fleet `launcher` places, then validates and publishes it."""

    # poll_seconds may be a template (a DAG param), rendered to text: read as a number at execute.
    template_fields: Sequence[str] = ("spec", "deadline", "poll_seconds")

    def __init__(self, *, spec: str, launcher: str = "local", workers: int = 1, deadline: str | None = None,
                 publish: bool = True, deferrable: bool = True, batchline_conn_id: str = "batchline_default",
                 launcher_options: Mapping[str, Any] | None = None, poll_seconds: float | str = 30.0,
                 max_store_failures: int = 10, publish_over_newer: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Why this task's version may be published although its name moved on since the run
        # planned (a newer night published): kept in the history. None: it is not.
        self.publish_over_newer = publish_over_newer
        self.spec = spec
        self.launcher = launcher
        self.workers = workers
        self.deadline = deadline
        self.publish = publish
        self.deferrable = deferrable
        self.batchline_conn_id = batchline_conn_id
        self.launcher_options = dict(launcher_options or {})
        self.poll_seconds = poll_seconds
        self.max_store_failures = max_store_failures
        self._request: Any = None
        self._finished: tuple[str, str, str | None] | None = None  # the store, version and name it published

    def _hook(self) -> BatchlineHook:
        return BatchlineHook(self.batchline_conn_id)

    def _launch_request(self, context: Mapping[str, Any], version: str, store_url: str) -> Any:
        from batchline.launch.fleet import LaunchRequest

        key = task_key(context)
        options = {**self._hook().launcher_options(self.launcher), **self.launcher_options}
        return LaunchRequest(version=version, spec=self.spec, key=key, plan_key=key, store_url=store_url,
                             workers=self.workers, deadline=self.deadline, options=options)

    def execute(self, context: Any) -> Any:
        from batchline.errors import ArgumentError, SpecError, StoreMissing

        try:
            return self._execute(context)
        except (SpecError, ArgumentError, StoreMissing) as exc:
            # What no retry can fix (a malformed spec, a refused option, a store that does not
            # exist): the task fails now, its retries unspent, nothing planned or launched.
            raise AirflowFailException(f"{type(exc).__name__}: {exc}") from None

    def _execute(self, context: Any) -> Any:
        from batchline.api import Jobs
        from batchline.launch.fleet import checked, launch_once, model_checks
        from batchline.spec import load_spec
        from batchline.store import open_store

        try:
            self.poll_seconds = float(self.poll_seconds)
        except ValueError:
            raise AirflowFailException(f"poll_seconds must be a number of seconds, not {self.poll_seconds!r}") from None
        if self.poll_seconds <= 0:
            raise AirflowFailException(f"poll_seconds must be more than 0, not {self.poll_seconds}")
        spec = load_spec(self.spec)
        needs_model = model_checks(spec)
        if needs_model:
            raise AirflowFailException(f"{self.spec}: {', '.join(needs_model)} run a model, which an Airflow worker does "
                                   f"not have: run `batchline validate` where the model is, or leave them out here")
        store_url = self._hook().store_url()
        key = task_key(context)
        # Refused before anything is planned: an unknown launcher, or an option it does not take.
        checked(self.launcher, self._launch_request(context, "", store_url))
        # Never a new store: a mistyped path in the connection is refused naming it, not a
        # new, empty store that computes every record again and publishes over the real one.
        planned = Jobs(store_url).plan(self.spec, plan_key=key, create_store=False, log=self.log.info)
        request = self._launch_request(context, planned.version, store_url)
        self._request = request
        with contextlib.closing(open_store(store_url, create=False)) as store:
            launched = launch_once(store, request, self.launcher, by=key)
            _name_lineage_parent(store, planned.version, context)
        what = "launched" if launched.launched_now else "re-attached to the fleet an earlier try launched:"
        self.log.info("%s %s (%s) %s", planned.version, what, self.launcher, launched.record.detail)
        if not self.deferrable:
            return self._finish(store_url, self._wait(planned.version), key)
        self.defer(trigger=BatchlineVersionTrigger(planned.version, self.batchline_conn_id, float(self.poll_seconds),
                                                   self.max_store_failures, launch_key=key, launcher=self.launcher,
                                                   launcher_options=dict(self.launcher_options)),
                   method_name="execute_complete")

    def _wait(self, version: str) -> dict[str, Any]:
        from batchline.launch.fleet import wait

        return wait(self._hook().store_url(), version, float(self.poll_seconds), self.log.warning,
                    self.max_store_failures, request=self._request).to_json()

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        return self._finish(self._hook().store_url(), event, task_key(context))

    def _finish(self, store_url: str, event: Mapping[str, Any], key: str) -> dict[str, Any]:
        version = str(event.get("version"))
        self._finished = (store_url, version, None)
        if event.get("state") == ERROR:
            raise AirflowException(str(event.get("message")))
        if event.get("state") != "sealed":
            raise AirflowException(f"{event.get('message')}; nothing published")
        shown = gate_and_publish(store_url, version, self.publish, self.log.info, plan_key=key,
                                 over_newer=self.publish_over_newer)
        self._finished = (store_url, version, shown["published_as"])
        return shown

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Airflow's lineage of the task: the input snapshot, the published table and
        batchline's run facets (nothing before the task has finished a version)."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        from batchline.lineage.events import version_lineage
        from batchline.store import open_store

        if self._finished is None:
            return OperatorLineage()
        store_url, version, published_as = self._finished
        with contextlib.closing(open_store(store_url, create=False)) as store:
            inputs, outputs, facets = version_lineage(store, version, published_as)
        return OperatorLineage(inputs=inputs, outputs=outputs, run_facets=facets)

    def on_kill(self) -> None:
        from batchline.launch.fleet import stop_launched
        from batchline.store import open_store

        if self._request is None:
            return
        with contextlib.closing(open_store(self._request.store_url, create=False)) as store:
            stop_launched(store, self._request, "the Airflow task was killed")


class BatchlinePublishOperator(BaseOperator):
    """Validates a sealed version (a job run with `publish=False` upstream, such as an index's
    embedding job) and publishes it: a few seconds on a worker, no fleet."""

    template_fields: Sequence[str] = ("version",)

    def __init__(self, *, version: str, batchline_conn_id: str = "batchline_default", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.version = version
        self.batchline_conn_id = batchline_conn_id

    def execute(self, context: Any) -> Any:
        from batchline.launch.fleet import model_checks
        from batchline.spec import JobVersion
        from batchline.store import open_store

        store_url = BatchlineHook(self.batchline_conn_id).store_url()
        with contextlib.closing(open_store(store_url, create=False)) as store:
            job = JobVersion.of(store, self.version)
        needs_model = model_checks(job.spec)
        if needs_model:
            raise AirflowException(f"{self.version}: {', '.join(needs_model)} run a model, which an Airflow worker "
                                   f"does not have: run `batchline validate` where the model is")
        return gate_and_publish(store_url, self.version, True, self.log.info)
