"""Anthropic's Message Batches API as a `BatchProvider`.

A shard's requests go in one ``POST /v1/messages/batches``. Structured output is
a forced tool call: each request offers one tool, ``record_output``, whose input
schema is the job's output schema, and requires the model to call it; the
answer is the call's input, serialised as JSON (a plain text answer is taken as
it is, and validation judges it).

A batch carries no metadata, so a batch is found again by what a submission
does fix: created at or after the time the worker began submitting, with as
many requests as the shard sent. Only a single such batch is adopted; two
candidates mean the match is not certain, and a second batch costs less than
answers stored under the wrong records.

Request params: model, max_tokens, the prompt as the one user message,
temperature, top_p (only when below 1: recent models refuse temperature and
top_p together, and 1 is no restriction), the tool and tool_choice, then the
route's ``options`` merged over them; an option set to null removes that field.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from batchline.providers.base import (
    BatchAnswer,
    BatchClient,
    BatchProgress,
    BatchRequest,
    ProviderError,
    ProviderHttp,
    SubmittedBatch,
    api_key,
    with_options,
)
from batchline.spec import DecodingSpec, ProviderSpec

if TYPE_CHECKING:
    import httpx

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_KEY_ENV = "ANTHROPIC_API_KEY"
API_VERSION = "2023-06-01"
TOOL_NAME = "record_output"
BATCHES = "/v1/messages/batches"
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The API's limits on one batch.
MAX_REQUESTS = 100_000
MAX_BODY_BYTES = 256 * 1024 * 1024


def parse_time(value: Any) -> float:
    """RFC 3339 (``2024-08-20T18:37:24.100435Z``) to epoch seconds; 0 when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return 0.0
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _total(batch: Mapping[str, Any]) -> int:
    counts = batch.get("request_counts") or {}
    return sum(int(v) for v in counts.values() if isinstance(v, int))


class AnthropicBatchProvider(BatchClient):
    api = "anthropic"

    def __init__(self, spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                 job_name: str, *, client: httpx.Client | None = None, max_tries: int = 5,
                 backoff_seconds: float = 0.5) -> None:
        key = api_key(spec, DEFAULT_KEY_ENV)
        super().__init__(spec, decoding, output_schema, job_name,
                         ProviderHttp("anthropic", spec.base_url or DEFAULT_BASE_URL,
                                      {"x-api-key": key, "anthropic-version": API_VERSION}, client=client,
                                      max_tries=max_tries, backoff_seconds=backoff_seconds))

    # --- requests ----------------------------------------------------------------------

    def acceptable_custom_id(self, value: str) -> bool:
        return _CUSTOM_ID.fullmatch(value) is not None

    def request_params(self, prompt: str) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": self.spec.model,
            "max_tokens": self.decoding.max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.decoding.temperature,
            "tools": [{"name": TOOL_NAME,
                       "description": "Record the answer. Call this exactly once with the complete answer.",
                       "input_schema": self.output_schema}],
            "tool_choice": {"type": "tool", "name": TOOL_NAME},
        }
        if self.decoding.top_p < 1.0:
            params["top_p"] = self.decoding.top_p
        return with_options(params, self.spec.options)

    # --- BatchProvider -----------------------------------------------------------------

    def submit(self, requests: Sequence[BatchRequest], tag: str) -> SubmittedBatch:
        if not requests:
            raise ProviderError("a batch needs at least one request")
        started = time.time()
        body = {"requests": [{"custom_id": r.custom_id, "params": self.request_params(r.prompt)}
                             for r in requests]}
        # Sent as bytes, so the size is checked once rather than guessed.
        content = json.dumps(body, ensure_ascii=False).encode("utf-8")
        if len(requests) > MAX_REQUESTS or len(content) > MAX_BODY_BYTES:
            raise ProviderError(f"a batch of {len(requests)} requests ({len(content)} bytes) is over the Anthropic "
                                f"limit of {MAX_REQUESTS} requests and {MAX_BODY_BYTES} bytes; lower the "
                                f"route's shard_size", fatal=True)
        created = self.http.create("POST", BATCHES, lambda: self.find(tag, len(requests), started),
                                   content=content, headers={"content-type": "application/json"})
        if isinstance(created, SubmittedBatch):
            return created
        return SubmittedBatch(api=self.api, batch_id=str(created.json()["id"]), tag=tag,
                              request_count=len(requests), submitted_at=time.time())

    def find(self, tag: str, request_count: int, since: float) -> SubmittedBatch | None:
        # No metadata to match on: the one batch of this size created since the intent.
        candidates = [b for b in self.http.recent(BATCHES, after_param="after_id", page_size=self.page_size,
                                                  since=since, created_at=lambda b: parse_time(b.get("created_at")))
                      if _total(b) == request_count]
        if len(candidates) != 1:
            return None
        found = candidates[0]
        return SubmittedBatch(api=self.api, batch_id=str(found["id"]), tag=tag, request_count=request_count,
                              submitted_at=parse_time(found.get("created_at")) or time.time())

    def progress(self, batch: SubmittedBatch) -> BatchProgress:
        data = self.http.json("GET", f"{BATCHES}/{batch.batch_id}")
        status = str(data.get("processing_status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items() if isinstance(v, int)}
        return BatchProgress(ended=status == "ended", status=status, counts=counts)

    def answers(self, batch: SubmittedBatch) -> Iterator[BatchAnswer]:
        data = self.http.json("GET", f"{BATCHES}/{batch.batch_id}")
        url = data.get("results_url")
        if not url:
            if data.get("processing_status") == "ended":
                raise ProviderError(f"batch {batch.batch_id} has ended but has no results_url")
            return
        for number, line in enumerate(self.http.lines(str(url)), start=1):
            if not line.strip():
                continue
            try:
                yield parse_result_line(line)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.problems.append(f"batch {batch.batch_id} results line {number}: {exc}")


def parse_result_line(line: str) -> BatchAnswer:
    """One line of a batch's results. Raises ValueError (or a lookup error) when the line
    is not one the API writes."""
    item = json.loads(line)
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("no custom_id")
    result = item["result"]
    kind = result.get("type")
    if kind == "expired":
        return BatchAnswer(custom_id, "expired")
    if kind == "canceled":
        return BatchAnswer(custom_id, "canceled")
    if kind == "errored":
        # {"type": "errored", "error": {"type": "error", "error": {"type": ..., "message": ...}}}
        outer = result.get("error") or {}
        nested = outer.get("error")
        inner: dict[str, Any] = nested if isinstance(nested, dict) else outer
        return BatchAnswer(custom_id, "error",
                           error=f"{inner.get('type') or 'error'}: {inner.get('message') or ''}")
    if kind != "succeeded":
        raise ValueError(f"unknown result type {kind!r}")
    message = result["message"]
    usage = message.get("usage") or {}
    common: dict[str, Any] = {"model": message.get("model"), "input_tokens": usage.get("input_tokens"),
                              "output_tokens": usage.get("output_tokens")}
    blocks = [b for b in message.get("content") or [] if isinstance(b, dict)]
    tool = next((b for b in blocks if b.get("type") == "tool_use" and b.get("name") == TOOL_NAME), None)
    if tool is not None:
        output = json.dumps(tool.get("input"), ensure_ascii=False)
    else:
        texts = [str(b.get("text") or "") for b in blocks if b.get("type") == "text"]
        if not texts:
            return BatchAnswer(custom_id, "error", error="the answer has neither the tool call nor text", **common)
        output = "".join(texts)
    if message.get("stop_reason") == "max_tokens":
        # Cut off: a truncated tool call's input is incomplete, so say so instead of passing it on.
        return BatchAnswer(custom_id, "error", output=output, error="the answer was cut off at max_tokens",
                           **common)
    return BatchAnswer(custom_id, "ok", output=output, **common)
