"""Dagster: a `BatchlineResource` (the store) and `batchline_asset`, an asset per job whose
materialisation is a published version, with one asset check per check of the job's gate.

Materialising the asset plans the job under the run's key (`dagster:RUN_ID/ASSET`: a retry
of the step in the same run finds the same version), launches the fleet once
(`batchline.launch.fleet`: a retried step re-attaches), waits for the seal, validates and
publishes. The asset's checks are the gate's checks, named from the spec
(`batchline.check.validate.check_names`), so a grader added to the spec is a new check
with nothing to change here. A failed gate reports its checks as failed and fails the step:
nothing is published, nothing materialised. The metadata: version, records, results, dead
letters, tokens, paid worker time and cost, where it was published.
"""

import contextlib

# No `from __future__ import annotations`: Dagster reads the asset function's annotations
# (its context's type, its resource's) as objects.
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetsDefinition,
    ConfigurableResource,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
)


class BatchlineResource(ConfigurableResource):  # type: ignore[type-arg]
    """The batchline store: its URL from the environment (`EnvVar("BATCHLINE_STORE")`) or
    Dagster's secrets, never written in the code; and each launcher's options."""

    store_url: str
    launcher_options: dict[str, dict[str, Any]] = {}  # noqa: RUF012 (a pydantic field: each instance its own copy)


def dagster_run_key(run: Any, asset: str) -> str:
    """The key a materialisation plans and launches under: its root run's, so a re-execution
    of a failed run (a new run id, the same root) finds the version and the fleet the first
    execution started instead of planning and launching again."""
    return f"dagster:{run.root_run_id or run.run_id}/{asset}"


def _metadata(manifest: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: manifest[k] for k in ("version", "records", "results", "computed", "carried",
                                                     "dead_letters", "input_tokens", "output_tokens",
                                                     "paid_worker_seconds", "paid_cost")}
    out["published_as"] = manifest["published_as"] or ""
    if manifest["targets"]:
        out["targets"] = MetadataValue.json(list(manifest["targets"]))
    return out


def batchline_asset(spec: str | Path, *, key: str | Sequence[str] | None = None, launcher: str = "local",
                    workers: int = 1, deadline: str | None = None, deps: Sequence[Any] = (),
                    poll_seconds: float = 10.0, group_name: str | None = None) -> AssetsDefinition:
    """An asset that runs the job of `spec` on the fleet and publishes it (see the module).
    `key` defaults to the job's name; `deps` are the assets it reads (the triage job an
    embedding job reads with `input.job`)."""
    from batchline.check.validate import check_names
    from batchline.launch.fleet import model_checks
    from batchline.spec import load_spec

    path = str(Path(spec).resolve())
    job = load_spec(path)
    needs_model = model_checks(job)
    if needs_model:
        from batchline.errors import SpecError

        raise SpecError(f"{path}: {', '.join(needs_model)} run a model, which a Dagster step does not have: run "
                        f"`batchline validate` where the model is, or leave them out here")
    asset_key = AssetKey([key or job.name] if key is None or isinstance(key, str) else list(key))
    checks = [AssetCheckSpec(name, asset=asset_key, description=f"batchline's gate: {name}")
              for name in check_names(job)]

    @asset(key=asset_key, deps=list(deps), check_specs=checks, group_name=group_name,
           description=f"batchline job {job.name}: {path}")
    def _run(context: AssetExecutionContext, batchline: BatchlineResource) -> Iterator[Any]:
        from batchline.api import Jobs
        from batchline.launch.fleet import LaunchRequest, launch_once, manifest, wait
        from batchline.store import open_store

        url = batchline.store_url
        run_key = dagster_run_key(context.run, asset_key.to_user_string())
        planned = Jobs(url).plan(path, plan_key=run_key, create_store=False, log=context.log.info)
        request = LaunchRequest(version=planned.version, spec=path, key=run_key, plan_key=run_key, store_url=url,
                                workers=workers, deadline=deadline,
                                options=dict(batchline.launcher_options.get(launcher, {})))
        with contextlib.closing(open_store(url, create=False)) as store:
            launched = launch_once(store, request, launcher, by=run_key)
        context.log.info(f"{planned.version} {'launched' if launched.launched_now else 're-attached'} ({launcher})")
        ended = wait(url, planned.version, poll_seconds, context.log.warning, request=request)
        if ended.state != "sealed":
            raise Failure(description=f"{ended.message}; nothing published")
        jobs = Jobs(url)
        report = jobs.validate(planned.version, log=context.log.info)
        results = [AssetCheckResult(check_name=c.name, passed=c.passed, asset_key=asset_key,
                                    metadata={"figure": c.figure, "version": planned.version})
                   for c in report.checks]
        if not report.passed:
            yield from results
            raise Failure(description=f"{planned.version} failed its gate; nothing published\n{report.table()}")
        publication = jobs.publish(planned.version, plan_key=run_key, log=context.log.info)
        with contextlib.closing(open_store(url, create=False)) as store:
            shown = manifest(store, planned.version, publication.name)
        yield MaterializeResult(asset_key=asset_key, metadata=_metadata(shown), check_results=results)

    return _run
