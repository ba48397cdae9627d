"""The OpenAI batch file format (`input.format: openai-batch`): request lines in, response and
error lines out (the `openai-batch` export writes these).

An input line is what OpenAI's Batch API and ``vllm run-batch`` take::

    {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [{"role": "user", "content": "..."}], "max_tokens": 200}}

batchline runs one model, one decoding setting and one output schema per job,
so a line may repeat the job's settings but never ask for others: a request
that would be answered differently from what it asked for is refused at
planning, naming its line, rather than answered quietly against its wishes.

Output lines have the shapes of OpenAI's batch output and error files, so the
tools that read those read these.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from batchline.errors import InputError
from batchline.formats.jsonl import JsonlFormat
from batchline.snapshot.reading import Record, content_hash
from batchline.spec import (
    OPENAI_BATCH,
    PENALTY_DEFAULTS,
    ChatRules,
    InputSpec,
    canonical_json,
    stop_sequences,
)

ENDPOINT = "/v1/chat/completions"
ROLES = ("system", "developer", "user", "assistant")
_LINE_KEYS = ("custom_id", "method", "url", "body")
_MESSAGE_KEYS = ("role", "content", "name")
# Keys a request may carry; anything else would change the answer in a way one
# job-wide engine setting cannot honour per request (tools, logit_bias...).
_BODY_KEYS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
              "response_format", "n", "stream", "user", "logprobs", "stop", *PENALTY_DEFAULTS)
_DECODING = ("temperature", "top_p", "seed")
_Refuse = Callable[[str], InputError]


@dataclass(frozen=True)
class ChatRequest:
    custom_id: str
    messages: tuple[dict[str, Any], ...]  # roles and plain-string contents, as the template gets them
    text: str  # the last user message: the record's own text (length cap, embeddings)
    model: str | None  # what the line asked for; the job's model answers


def parse_request(obj: Mapping[str, Any], where: str, rules: ChatRules | None) -> ChatRequest:
    """One input line, checked; every refusal is one line naming `where` (file:line) and the custom_id."""
    raw_id = obj.get("custom_id")
    if not isinstance(raw_id, str) or not raw_id.strip():
        what = "missing" if raw_id is None else f"{raw_id!r}, not a non-empty string"
        raise InputError(f"{where}: custom_id is {what}")
    at = f"{where}: custom_id {raw_id!r}"

    def refuse(message: str) -> InputError:
        return InputError(f"{at}: {message}")

    unknown = sorted(set(obj) - set(_LINE_KEYS))
    if unknown:
        raise refuse(f"unknown field {unknown[0]!r} (a line has {', '.join(_LINE_KEYS)})")
    if obj.get("method") != "POST":
        raise refuse(f"method is {obj.get('method')!r}; batch requests are POST")
    if obj.get("url") != ENDPOINT:
        raise refuse(f"url {obj.get('url')!r} is not supported; only {ENDPOINT} is (chat completions)")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise refuse("body must be a JSON object")
    for key in sorted(body):
        if key not in _BODY_KEYS:
            raise refuse(f"body.{key} is not supported (a request may set {', '.join(_BODY_KEYS)}, "
                         "and decoding must match the job's)")
    if body.get("n", 1) != 1:
        raise refuse(f"body.n is {body['n']!r}; batchline answers each custom_id once (n: 1)")
    if body.get("stream", False) not in (False, None):
        raise refuse("body.stream is true; a batch answer is never streamed")
    if body.get("logprobs", False) not in (False, None):
        raise refuse("body.logprobs is not supported; outputs carry no log-probabilities")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise refuse(f"body.model must be a string, not {type(model).__name__}")
    messages = _messages(body.get("messages"), refuse)
    if rules is not None:
        _check_decoding(body, rules, refuse)
        _check_response_format(body.get("response_format"), rules, refuse)
    last_user = next(m["content"] for m in reversed(messages) if m["role"] == "user")
    return ChatRequest(raw_id, messages, last_user, model)


def _messages(raw: Any, refuse: _Refuse) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise refuse("body.messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        here = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise refuse(f"{here} must be an object with role and content")
        extra = sorted(set(m) - set(_MESSAGE_KEYS))
        if extra:
            raise refuse(f"{here}.{extra[0]} is not supported (tool calls and audio are not; "
                         f"a message has {', '.join(_MESSAGE_KEYS)})")
        role = m.get("role")
        if role not in ROLES:
            raise refuse(f"{here}.role {role!r} is not supported (roles: {', '.join(ROLES)})")
        message: dict[str, Any] = {
            # OpenAI's newer name for the system role; chat templates know only "system".
            "role": "system" if role == "developer" else role,
            "content": _content(m.get("content"), here, refuse),
        }
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise refuse(f"{here}.name must be a string")
            message["name"] = m["name"]
        out.append(message)
    if not any(m["role"] == "user" for m in out):
        raise refuse("body.messages has no user message")
    return tuple(out)


def _content(raw: Any, here: str, refuse: _Refuse) -> str:
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise refuse(f"{here}.content must be a string or a list of text parts, not "
                     f"{'null' if raw is None else type(raw).__name__}")
    texts: list[str] = []
    for j, part in enumerate(raw):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise refuse(f"{here}.content[{j}] is a {kind or type(part).__name__!r} part; only text parts "
                         "are supported (the engines here read text, not images, audio or files)")
        if not isinstance(part.get("text"), str):
            raise refuse(f"{here}.content[{j}].text must be a string")
        texts.append(part["text"])
    # Parts joined as vLLM joins them for a chat template that takes strings.
    return "\n".join(texts)


def _check_decoding(body: Mapping[str, Any], rules: ChatRules, refuse: _Refuse) -> None:
    job = rules.decoding
    asked: list[tuple[str, Any, float]] = [(k, body[k], job.max_tokens) for k in ("max_tokens", "max_completion_tokens")
                                           if body.get(k) is not None]
    asked += [(k, body[k], getattr(job, k)) for k in _DECODING if body.get(k) is not None]
    # An unset penalty is the neutral one, which a request may name.
    asked += [(k, body[k], _or(getattr(job, k), neutral)) for k, neutral in PENALTY_DEFAULTS.items()
              if body.get(k) is not None]
    for key, value, job_value in asked:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise refuse(f"body.{key} must be a number, not {value!r}")
        if not math.isclose(float(value), float(job_value), rel_tol=0.0, abs_tol=1e-9):
            raise _disagrees(refuse, key, value, job_value)
    if body.get("stop") is not None:
        def bad_stop(message: str) -> NoReturn:
            raise refuse(f"body.stop {message}")

        stop = stop_sequences(body["stop"], bad_stop)
        if stop != job.stop:
            raise _disagrees(refuse, "stop", list(stop), list(job.stop))


def _disagrees(refuse: _Refuse, key: str, value: Any, job_value: Any) -> InputError:
    job_key = "max_tokens" if key.startswith("max_") else key
    return refuse(f"body.{key} is {value!r} but the job's decoding.{job_key} is {job_value!r}; "
                  "an engine runs one decoding setting per job: set decoding in the job spec to "
                  "match, or split the file by setting")


def _or(value: float | None, neutral: float) -> float:
    return neutral if value is None else value


def _check_response_format(fmt: Any, rules: ChatRules, refuse: _Refuse) -> None:
    if fmt is None:
        return  # answered as JSON valid against the job's schema, as every record is
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema != dict(rules.output_schema):
            raise refuse("body.response_format.json_schema.schema differs from the job's output.schema; "
                         "one job answers with one schema: set output.schema to it, or split the file by schema")
        return
    raise refuse(f"body.response_format type {kind!r} is not supported: every answer is JSON valid against "
                 "the job's output.schema (use json_schema with that schema, json_object, or leave it out)")


def messages_hash_text(messages: tuple[dict[str, Any], ...]) -> str:
    """What a chat record's content hash covers: the whole conversation, so changing
    any message (not only the last user turn) makes the record new."""
    return "\0openai-batch\0" + canonical_json(list(messages))


# --- output lines --------------------------------------------------------------


def _stable(kind: str, version: str, custom_id: str) -> str:
    """Ids that come out the same on every export of a version, so re-exporting
    (after a resume, or again) never makes one request look like two."""
    return hashlib.sha256(f"{kind}\0{version}\0{custom_id}".encode()).hexdigest()[:32]


def response_line(version: str, custom_id: str, content: str, created: float, model: str,
                  input_tokens: int | None, output_tokens: int | None) -> dict[str, Any]:
    usage = None
    if input_tokens is not None and output_tokens is not None:
        usage = {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                 "total_tokens": input_tokens + output_tokens}
    return {
        "id": f"batch_req_{_stable('line', version, custom_id)}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{_stable('request', version, custom_id)}",
            "body": {
                "id": f"chatcmpl-{_stable('completion', version, custom_id)}",
                "object": "chat.completion",
                "created": int(created),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop", "logprobs": None}],
                "usage": usage,
            },
        },
        "error": None,
    }


def error_line(version: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{_stable('line', version, custom_id)}", "custom_id": custom_id,
            "response": None, "error": {"code": code, "message": message}}


class OpenAIBatchFormat(JsonlFormat):
    """Request lines of OpenAI's Batch API: JSONL read in byte ranges, each line a conversation
    (its messages), never guessed from a suffix since such a file is also plain JSONL."""

    name: ClassVar[str] = OPENAI_BATCH
    suffixes: ClassVar[tuple[str, ...]] = ()
    chat: ClassVar[bool] = True

    def record(self, obj: dict[str, Any], path: Path | str, line_no: int, spec: InputSpec) -> Record:
        req = parse_request(obj, f"{path}:{line_no}", spec.chat_rules)
        return Record(req.custom_id, req.text, None, content_hash(messages_hash_text(req.messages), None),
                      line_no, messages=req.messages)


OPENAI_BATCH_FILES = OpenAIBatchFormat()
