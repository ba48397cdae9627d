"""Searching a published version: `batchline search` and `Jobs.search`.

The search port (`batchline.targets.base.Searchable`) is filled by whichever target of
the published version's spec its readers search (a LanceDB index, or any other member of
the TARGETS table that declares the port); this module names none of them. What it adds
around the target's ranking is the same for every one:

- the caller's groups and `k` are checked before anything is read (`batchline.acl`), and
  a name that is not published is refused (exit 66), both before the model loads;
- the query is embedded by the version's own engine, its pinned weights verified when it
  loads (once per process and model: later searches reuse it), in the engine runtime the
  version's rows were computed with (I2): another build of the same model can put a text
  elsewhere, and its hits would be ranked by a vector no row was made with;
- where the version reads a published job (`input.job`), each candidate is admitted by
  the ACL that job publishes now (`batchline.publish.upstream.CurrentAcls`), and the
  result says whether the version is behind its upstream;
- a version pruned between reading the name's pointer and searching it (two publishes
  meanwhile) is searched again at the name's new version.
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass, replace
from typing import Any

from batchline.acl import caller_groups, check_k
from batchline.errors import BatchlineError, EngineFatal, NotPublished
from batchline.publish.upstream import CurrentAcls, UpstreamLag, lag
from batchline.spec import JobSpec, JobVersion
from batchline.store import ReaderStore
from batchline.targets import keyed_families
from batchline.targets.base import Hit, Searchable, searchable


@dataclass(frozen=True)
class SearchResult:
    name: str
    version: str  # the published version every hit was answered from
    hits: list[Hit]  # nearest first
    path: str = "exact"  # how its target ranked (for a LanceDB index: ivf_pq, exact, or fallback)
    withheld: int = 0  # candidates the upstream's current ACLs withheld (revoked since the version was planned)
    behind: tuple[UpstreamLag, ...] = ()  # each upstream it reads (input.job), and whether it is behind it


def search(store: ReaderStore, name: str, query: str, groups: Any, *, k: int = 10,
           count_behind: bool = False) -> SearchResult:
    """The `k` records of the version published as `name` nearest `query` among those whose
    ACL names one of `groups` exactly (see the module's doc); `count_behind`: say by how
    many records the version is behind its upstream (a keyed join over both)."""
    checked = caller_groups(groups, "groups")
    k = check_k(k)
    for attempt in range(2):
        version = store.resolve_name(name)
        if version is None:
            raise NotPublished(name, store.where())
        job = JobVersion.of(store, version)
        target = searched(job.spec)  # refused before the model loads
        _same_runtime(store, version, job.spec)
        current = CurrentAcls.of(store, job.info)
        vector = target.query_vector(_embed(job.spec, query))
        admit = None if current is None else functools.partial(current.admitted, groups=checked)
        try:
            answer = target.search(name, version, vector, checked, k, storage=job.spec.input.storage, admit=admit)
        except BatchlineError:
            # Two publishes since the pointer was read can prune its version: read it again.
            if attempt == 1 or store.resolve_name(name) == version:
                raise
            continue
        return SearchResult(name, version, answer.hits, answer.path, answer.withheld,
                            tuple(lag(store, job.info, count=count_behind)))
    raise AssertionError("unreachable")


def searched(spec: JobSpec) -> Searchable:
    """The target of the version's spec that is searched; refused, naming the output keys that
    make one, where it has none."""
    found = searchable(spec)
    if found is None:
        keys = sorted(key for key, family in keyed_families().items() if family.searchable)
        raise BatchlineError(f"{spec.name} has no {' or '.join(f'output.{k}' for k in keys)}: nothing of it is "
                             "searched")
    return found


def _same_runtime(store: ReaderStore, version: str, spec: JobSpec) -> None:
    """The query is embedded by the engine runtime the version's rows were (I2)."""
    from batchline.engines import engine_runtime

    pinned, here = store.pinned_runtime(version), engine_runtime(spec.model.engine)
    if pinned is not None and here is not None and pinned != here:
        raise EngineFatal(f"{version}'s vectors were computed with the engine runtime {pinned}, and this "
                          f"environment's is {here}: search from an environment with {pinned}")


def _embed(spec: JobSpec, text: str) -> str:
    """The job's engine's output for `text`, given as a record's text: its pinned weights,
    verified when the engine is loaded (once per process and model)."""
    from batchline.engines.base import EngineRequest

    with _ENGINES_LOCK:
        engine = _query_engine(spec)
        outcomes = list(engine.generate(_OneRequest(EngineRequest("query", text, "", text))))
    if len(outcomes) != 1 or outcomes[0].output is None:
        error = outcomes[0].error if outcomes else "no outcome"
        raise BatchlineError(f"the job's engine could not embed the query: {error}")
    output: str = outcomes[0].output
    return output


_ENGINES: dict[str, Any] = {}
_ENGINES_LOCK = threading.Lock()


def _query_engine(spec: JobSpec) -> Any:
    from batchline.engines import create_engine
    from batchline.engines.base import EngineConfig
    from batchline.worker.weights import local_weights

    key = json.dumps([spec.model.engine, spec.model.path, spec.model.digest, dict(spec.model.options),
                      dict(spec.output_schema)], sort_keys=True, default=str)
    engine = _ENGINES.get(key)
    if engine is None:
        model = replace(spec.model, path=local_weights(spec.model.path, spec.model.digest, spec.input.storage))
        engine = create_engine(EngineConfig(model=model, decoding=spec.decoding, output_schema=spec.output_schema))
        engine.load()
        _ENGINES[key] = engine
    return engine


class _OneRequest:
    """A request source holding one request."""

    def __init__(self, request: Any) -> None:
        self.pending = [request]

    def next_batch(self, max_items: int) -> list[Any]:
        taken, self.pending = self.pending[:max_items], self.pending[max_items:]
        return taken

    poll = next_batch

