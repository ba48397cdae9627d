"""The `Engine` protocol: records stream in, per-record outcomes stream out.

An engine runs inside the worker's engine child process. It pulls requests from
a `RequestSource` as it has room (a continuous-batching engine keeps its batch
full) and yields one `EngineOutcome` per request as each completes, in any
order. A per-record failure is an outcome with `error`; a failure that means
the engine cannot go on raises `EngineFatal`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from batchline.digests import verify_weights
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec


@dataclass(frozen=True)
class EngineRequest:
    record_id: str
    prompt: str  # the full prompt: the shared instruction prefix first, then the record
    prefix: str  # the shared instruction prefix, identical for every record of a job
    text: str  # the record's own text (embedding engines read this)
    # An OpenAI-style conversation (roles and string contents). The supervisor sends it
    # with an empty prompt; the engine child renders it with the engine's chat template.
    messages: tuple[dict[str, Any], ...] | None = None


@dataclass
class EngineOutcome:
    record_id: str
    output: str | None = None  # the model's output text, expected to be JSON
    error: str | None = None
    error_kind: str | None = None  # "engine_error" (charged) or "too_long" (not charged)
    input_tokens: int | None = None
    output_tokens: int | None = None
    # Why the generation ended: "stop" (the model, a stop string or the grammar ended it)
    # or "length" (it reached decoding.max_tokens); None where the engine cannot tell.
    finish_reason: str | None = None
    constrained: bool = False  # a grammar held the output to the schema while it was decoded


class RequestSource(Protocol):
    """Requests for the engine, as the supervisor sends them."""

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        """Blocks until at least one request is there, returns up to `max_items`
        of those waiting; an empty list means no more requests will come."""
        ...

    def poll(self, max_items: int) -> list[EngineRequest]:
        """Returns up to `max_items` requests that are waiting now, without blocking."""
        ...


def batches(requests: RequestSource, size: int) -> Iterator[list[EngineRequest]]:
    """The source's requests in batches of at most `size`, until it says no more will come."""
    while batch := requests.next_batch(size):
        yield batch


def one_at_a_time(requests: RequestSource) -> Iterator[EngineRequest]:
    """For an engine that decodes one record at a time: it takes a record only when it
    starts it, so a worker that stops can take back every record not yet started."""
    while batch := requests.next_batch(1):
        yield batch[0]


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


def plain_chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation for an engine without a chat template: one `role: content` block a
    message, then the assistant's turn left open for the model to write."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt(engine: Engine, messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt for a conversation: the engine's own chat template (an optional
    `chat_prompt` method) when it has one, else the plain form."""
    render = getattr(engine, "chat_prompt", None)
    if render is None:
        return plain_chat_prompt(messages)
    prompt: str = render(messages)
    return prompt


def hf_chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template: str | None = None) -> str:
    """A conversation through a chat template: `template` (a model option), else the
    Hugging Face tokenizer's own; the plain form without either."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        return plain_chat_prompt(messages)
    prompt: str = tokenizer.apply_chat_template([dict(m) for m in messages], chat_template=template,
                                                tokenize=False, add_generation_prompt=True)
    return prompt


def hf_templated(tokenizer: Any, request: EngineRequest, template: str | None = None) -> bool:
    """Whether a request's prompt came from a chat template, which writes its own special
    tokens (BOS among them): adding them again would double them."""
    return request.messages is not None and bool(template or getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from; all of it is part of the job version."""

    model: ModelSpec
    decoding: DecodingSpec
    output_schema: Mapping[str, Any]
    work_dir: Path = field(default_factory=Path.cwd)


def torch_device_computes_on(device: str) -> str:
    """What a worker of a torch engine computed on, from the device its options name (auto:
    CUDA where a GPU is visible): the words `capacity --from-run` sizes a run by."""
    if device == "auto":
        return "a GPU where the worker had one, else the CPU (device: auto)"
    if device == "cpu":
        return "the CPU"
    return "a GPU" if device.startswith("cuda") else f"the {device} device"


def loaded(weights: Path | None, digest: str | None, *packages: str, missing: str) -> list[Any]:
    """What every engine's `load` opens with: its weights checked against the job's pinned digest
    (`weights` None: none to check), then the packages it runs on imported, each module in the
    order named; `EngineFatal` with `missing` (the line that says which extra brings them) where
    one is not installed."""
    import importlib

    if weights is not None:
        verify_weights(weights, digest)
    try:
        return [importlib.import_module(name) for name in packages]
    except ImportError:
        raise EngineFatal(missing) from None
