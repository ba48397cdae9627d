"""Hosted batch providers: the port a hosted route's shards are worked through.

A provider takes a shard's cleared records as one batch, and is asked about it
later by whichever worker polls: nothing here holds a lease while the provider
works. `submit` must be safe to follow with `find`: a worker that died between
creating a batch and recording its id must be able to adopt that batch rather
than pay for a second one.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

CUSTOM_ID_PREFIX = "bl-"


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str  # the record id, or its reversible mapping (see `custom_id_map`)
    prompt: str  # the full prompt, sent as the one user message


@dataclass(frozen=True)
class SubmittedBatch:
    """What the shard table keeps about a batch in flight at a provider."""

    api: str  # openai | anthropic
    batch_id: str
    tag: str  # version/shard/epoch of the submission, written into the batch where the API allows
    request_count: int
    submitted_at: float  # the store's clock when it was recorded
    input_file_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SubmittedBatch:
        return cls(api=data["api"], batch_id=data["batch_id"], tag=data["tag"],
                   request_count=int(data["request_count"]), submitted_at=float(data["submitted_at"]),
                   input_file_id=data.get("input_file_id"), extra=dict(data.get("extra") or {}))


@dataclass(frozen=True)
class BatchProgress:
    ended: bool  # True once the provider will change nothing more (completed, expired, failed, cancelled)
    status: str  # the provider's own word for it
    counts: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # a batch-level failure (the input file was refused, ...)


@dataclass(frozen=True)
class BatchAnswer:
    custom_id: str
    kind: str  # ok | error | expired | canceled
    output: str | None = None  # the model's answer text, expected to be JSON
    error: str | None = None
    model: str | None = None  # the model the provider says answered
    input_tokens: int | None = None
    output_tokens: int | None = None


class BatchProvider(Protocol):
    api: str

    def acceptable_custom_id(self, value: str) -> bool:
        """Whether the API takes this string as a request's custom id as it is."""
        ...

    def submit(self, requests: Sequence[BatchRequest], tag: str) -> SubmittedBatch:
        """Uploads and creates one batch; raises ProviderError when refused."""
        ...

    def find(self, tag: str, request_count: int, since: float) -> SubmittedBatch | None:
        """A batch created for `tag` at or after `since` (epoch seconds), if the provider has one."""
        ...

    def progress(self, batch: SubmittedBatch) -> BatchProgress: ...

    def answers(self, batch: SubmittedBatch) -> Iterator[BatchAnswer]:
        """Every answer of an ended batch (output and error files alike), as the provider gives them."""
        ...

    def close(self) -> None: ...


class ProviderError(Exception):
    """The provider refused or failed a call after retries; `fatal` when retrying cannot help
    (credentials refused, the model does not exist)."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def custom_id_map(record_ids: Iterable[str], acceptable: Callable[[str], bool]) -> dict[str, str]:
    """custom id -> record id for one shard. An acceptable id is its own custom id; any
    other (and any id that looks like a mapped one) becomes the prefix plus its URL-safe
    base64, or plus a digest when that is too long. Within a shard the map is one to one,
    so every answer finds its record again."""
    out: dict[str, str] = {}
    for record_id in record_ids:
        if acceptable(record_id) and not record_id.startswith(CUSTOM_ID_PREFIX):
            custom = record_id
        else:
            encoded = base64.urlsafe_b64encode(record_id.encode()).decode().rstrip("=")
            custom = CUSTOM_ID_PREFIX + encoded
            if not acceptable(custom):
                custom = CUSTOM_ID_PREFIX + "h-" + hashlib.sha256(record_id.encode()).hexdigest()[:40]
        if custom in out and out[custom] != record_id:
            raise ValueError(f"custom ids of {out[custom]!r} and {record_id!r} collide")
        out[custom] = record_id
    return out
