"""The OpenAI Batch API as a `BatchProvider`.

A shard's requests are uploaded as one JSONL file (``POST /files``, purpose
``batch``), each line a chat completion with the job's JSON Schema as a
structured-output response format, and one batch is created from it
(``POST /batches``) with the submission's tag in its metadata, so that a worker
that died before recording the batch id can find the batch again
(``GET /batches``) instead of paying for a second one. Answers come from the
batch's output file (successes) and error file (per-request failures, and the
requests the batch did not reach before it expired or was cancelled).

Request body: model, the prompt as the one user message, max_completion_tokens,
temperature, top_p, seed and the response format, then the route's ``options``
merged over them; an option set to null removes that field (reasoning models
refuse temperature and top_p).
"""

from __future__ import annotations

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

DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
ENDPOINT = "/v1/chat/completions"
TAG_KEY = "batchline_tag"
ENDED = frozenset({"completed", "expired", "failed", "cancelled"})
# Stricter than the API needs: these characters survive every tool that reads the files.
_CUSTOM_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# The API's limits on one batch's input file.
MAX_REQUESTS = 50_000
MAX_FILE_BYTES = 200 * 1024 * 1024


def schema_name(job_name: str) -> str:
    """The response format's name: the API takes only ``[a-zA-Z0-9_-]{1,64}``."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", job_name)[:64] or "output"


def strict_compatible(schema: Any) -> bool:
    """Whether OpenAI's strict structured outputs take this schema: the root is an object
    and every object forbids additional properties and requires all of its properties.
    Strict mode refuses any other schema outright, so anything else is sent non-strict."""
    if not isinstance(schema, Mapping) or not _is_object(schema):
        return False
    return _strict_all(schema)


def _is_object(node: Mapping[str, Any]) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node


def _strict_all(node: Any) -> bool:
    if isinstance(node, list):
        return all(_strict_all(item) for item in node)
    if not isinstance(node, Mapping):
        return True
    if _is_object(node):
        properties = node.get("properties") or {}
        if node.get("additionalProperties") is not False:
            return False
        if not isinstance(properties, Mapping) or set(node.get("required") or ()) != set(properties):
            return False
    for key in ("properties", "$defs", "definitions"):
        children = node.get(key)
        if isinstance(children, Mapping) and not all(_strict_all(c) for c in children.values()):
            return False
    return all(_strict_all(node[key]) for key in ("items", "prefixItems", "anyOf", "allOf", "oneOf")
               if key in node)


class OpenAIBatchProvider(BatchClient):
    api = "openai"

    def __init__(self, spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                 job_name: str, *, client: httpx.Client | None = None, max_tries: int = 5,
                 backoff_seconds: float = 0.5) -> None:
        key = api_key(spec, DEFAULT_KEY_ENV)
        super().__init__(spec, decoding, output_schema, job_name,
                         ProviderHttp("openai", spec.base_url or DEFAULT_BASE_URL, {"Authorization": f"Bearer {key}"},
                                      client=client, max_tries=max_tries, backoff_seconds=backoff_seconds))

    # --- requests ----------------------------------------------------------------------

    def acceptable_custom_id(self, value: str) -> bool:
        return _CUSTOM_ID.fullmatch(value) is not None

    def request_body(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.spec.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_completion_tokens": self.decoding.max_tokens,
            "temperature": self.decoding.temperature,
            "top_p": self.decoding.top_p,
            "seed": self.decoding.seed,
            # frequency_penalty, presence_penalty and stop, where set; the others are refused
            # when the job is parsed.
            **self.decoding.knobs(),
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": schema_name(self.job_name), "schema": self.output_schema,
                                "strict": strict_compatible(self.output_schema)},
            },
        }
        return with_options(body, self.spec.options)

    def input_file(self, requests: Sequence[BatchRequest]) -> bytes:
        lines = [json.dumps({"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT,
                             "body": self.request_body(r.prompt)}, ensure_ascii=False)
                 for r in requests]
        return ("\n".join(lines) + "\n").encode("utf-8")

    # --- BatchProvider -----------------------------------------------------------------

    def submit(self, requests: Sequence[BatchRequest], tag: str) -> SubmittedBatch:
        if not requests:
            raise ProviderError("a batch needs at least one request")
        content = self.input_file(requests)
        if len(requests) > MAX_REQUESTS or len(content) > MAX_FILE_BYTES:
            # Every retry would be refused the same way: the route's shard_size must come down.
            raise ProviderError(f"a batch of {len(requests)} requests ({len(content)} bytes) is over the OpenAI "
                                f"limit of {MAX_REQUESTS} requests and {MAX_FILE_BYTES} bytes; lower the "
                                f"route's shard_size", fatal=True)
        started = time.time()
        upload = self.http.json("POST", "/files", data={"purpose": "batch"},
                                files={"file": (f"{schema_name(tag)}.jsonl", content, "application/jsonl")})
        file_id = str(upload["id"])
        create = {"input_file_id": file_id, "endpoint": ENDPOINT,
                  "completion_window": self.spec.completion_window, "metadata": {TAG_KEY: tag}}
        created = self.http.create("POST", "/batches", lambda: self.find(tag, len(requests), started), json=create)
        if isinstance(created, SubmittedBatch):
            return created
        return SubmittedBatch(api=self.api, batch_id=str(created.json()["id"]), tag=tag,
                              request_count=len(requests), submitted_at=time.time(), input_file_id=file_id)

    def find(self, tag: str, request_count: int, since: float) -> SubmittedBatch | None:
        for batch in self.http.recent("/batches", after_param="after", page_size=self.page_size, since=since,
                                      created_at=lambda b: float(b.get("created_at") or 0)):
            metadata = batch.get("metadata") or {}
            # A batch that failed validation never ran: it is no submission to adopt.
            if metadata.get(TAG_KEY) == tag and batch.get("status") != "failed":
                return SubmittedBatch(api=self.api, batch_id=str(batch["id"]), tag=tag,
                                      request_count=request_count,
                                      submitted_at=float(batch.get("created_at") or time.time()),
                                      input_file_id=batch.get("input_file_id"))
        return None

    def progress(self, batch: SubmittedBatch) -> BatchProgress:
        data = self.http.json("GET", f"/batches/{batch.batch_id}")
        status = str(data.get("status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items() if isinstance(v, int)}
        error = _batch_errors(data) if status == "failed" else None
        return BatchProgress(ended=status in ENDED, status=status, counts=counts, error=error)

    def answers(self, batch: SubmittedBatch) -> Iterator[BatchAnswer]:
        data = self.http.json("GET", f"/batches/{batch.batch_id}")
        for file_id in (data.get("output_file_id"), data.get("error_file_id")):
            if not file_id:
                continue
            for number, line in enumerate(self.http.lines(f"/files/{file_id}/content"), start=1):
                if not line.strip():
                    continue
                try:
                    yield parse_answer_line(line)
                except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
                    self.problems.append(f"batch {batch.batch_id} file {file_id} line {number}: {exc}")


def _batch_errors(data: Mapping[str, Any]) -> str:
    errors = (data.get("errors") or {}).get("data") or []
    parts = []
    for e in errors:
        where = f" (line {e['line']})" if e.get("line") is not None else ""
        parts.append(f"{e.get('code') or 'error'}: {e.get('message') or ''}{where}")
    return "; ".join(parts) or "the batch failed without saying why"


def parse_answer_line(line: str) -> BatchAnswer:
    """One line of an output or error file. Raises ValueError (or a lookup error) when the
    line is not one the Batch API writes."""
    item = json.loads(line)
    if not isinstance(item, dict):
        raise ValueError("not a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("no custom_id")
    error = item.get("error")
    if error:
        code = str(error.get("code") or "")
        if code == "batch_expired":
            return BatchAnswer(custom_id, "expired", error=error.get("message"))
        if code == "batch_cancelled":
            return BatchAnswer(custom_id, "canceled", error=error.get("message"))
        return BatchAnswer(custom_id, "error", error=f"{code or 'error'}: {error.get('message') or ''}")
    response = item["response"]
    status = int(response.get("status_code") or 0)
    body = response.get("body") or {}
    if status != 200:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            text = f"{detail.get('type') or detail.get('code') or 'error'}: {detail.get('message') or ''}"
        else:
            text = str(body)[:300]
        return BatchAnswer(custom_id, "error", error=f"HTTP {status}: {text}")
    usage = body.get("usage") or {}
    message = body["choices"][0]["message"]
    finish = body["choices"][0].get("finish_reason")
    common: dict[str, Any] = {"model": body.get("model"), "input_tokens": usage.get("prompt_tokens"),
                              "output_tokens": usage.get("completion_tokens")}
    if message.get("refusal"):
        return BatchAnswer(custom_id, "error", error=f"the model refused: {message['refusal']}", **common)
    content = message.get("content")
    if not isinstance(content, str):
        return BatchAnswer(custom_id, "error", error="the answer has no content", **common)
    if finish == "length":
        # Cut off at max_completion_tokens: the JSON is incomplete, and saying so reads
        # better in a dead letter than the parse error validation would give.
        return BatchAnswer(custom_id, "error", output=content,
                           error="the answer was cut off at max_tokens", **common)
    return BatchAnswer(custom_id, "ok", output=content, **common)
