"""The `Engine` protocol: records stream in, per-record outcomes stream out.

An engine runs inside the worker's engine child process. It pulls requests from
a `RequestSource` as it has room (a continuous-batching engine keeps its batch
full) and yields one `EngineOutcome` per request as each completes, in any
order. A per-record failure is an outcome with `error`; a failure that means
the engine cannot go on raises `EngineFatal`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchline.spec import DecodingSpec, ModelSpec


@dataclass(frozen=True)
class EngineRequest:
    record_id: str
    prompt: str  # the full prompt: the shared instruction prefix first, then the record
    prefix: str  # the shared instruction prefix, identical for every record of a job
    text: str  # the record's own text (embedding engines read this)


@dataclass
class EngineOutcome:
    record_id: str
    output: str | None = None  # the model's output text, expected to be JSON
    error: str | None = None
    error_kind: str | None = None  # "engine_error" (charged) or "too_long" (not charged)
    input_tokens: int | None = None
    output_tokens: int | None = None


class RequestSource(Protocol):
    """Requests for the engine, as the supervisor sends them."""

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        """Blocks until at least one request is there, returns up to `max_items`
        of those waiting; an empty list means no more requests will come."""
        ...

    def poll(self, max_items: int) -> list[EngineRequest]:
        """Returns up to `max_items` requests that are waiting now, without blocking."""
        ...


class ListRequestSource:
    """A fixed list of requests, for running an engine in-process (benchmarks, tools)."""

    def __init__(self, requests: list[EngineRequest]) -> None:
        self.pending = list(requests)

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        batch, self.pending = self.pending[:max_items], self.pending[max_items:]
        return batch

    def poll(self, max_items: int) -> list[EngineRequest]:
        return self.next_batch(max_items)


class Engine(Protocol):
    def load(self) -> None:
        """Loads the model and verifies its pinned digest; raises EngineFatal on failure."""
        ...

    def count_tokens(self, text: str) -> int:
        """The exact number of input tokens the engine's tokenizer gives this prompt."""
        ...

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from; all of it is part of the job version."""

    model: ModelSpec
    decoding: DecodingSpec
    output_schema: Mapping[str, Any]
    work_dir: Path = field(default_factory=Path.cwd)
