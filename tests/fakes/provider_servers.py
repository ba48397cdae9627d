"""TEST FAKE: local stand-ins for the OpenAI Batch API and Anthropic's Message Batches API.

The real services cannot be reached from the test machines, so these servers play
them: a threaded stdlib HTTP server on 127.0.0.1 (port 0) per test, speaking the
request and answer shapes of the real APIs closely enough that a client that gets
a shape wrong is refused here too (400 with the API's error body; 401 without the
key), and with knobs for the faults a real batch can have.

    with openai_batch_server(answer=...) as server:      # server.base_url ends in /v1
        server.expire_ids.add("r3")
        provider = OpenAIBatchProvider(spec_with(base_url=server.base_url), ...)

Controls (set them before the batch ends):
  answer(custom_id, request_body) -> text   the model's answer; raise FakeAnswerError
                                            to make that request's answer an error.
                                            Default: a JSON object valid for the schema
                                            the request itself carries.
  expire_ids, error_ids, duplicate_ids      sets of custom ids: expired, errored, or
                                            answered twice (the second answer differs)
  fail_batch                                OpenAI: the batch fails validation (status
                                            "failed" with errors); Anthropic: the create
                                            is refused with a 400
  complete_after_polls                      status polls that still see the batch in
                                            progress before it ends (per batch)
  batch_status_on_end                       OpenAI's status word once ended: "completed"
                                            or "expired" (which requests expired is
                                            still expire_ids)
  fail_next                                 HTTP statuses to answer the next requests
                                            with, one each, before serving normally
                                            (429s carry Retry-After: retry_after)
  served_model                              the model the answers name (default: the
                                            one requested)
  fail_downloads                            like fail_next, for downloads of results only
  drop_create_replies                       creations whose batch is made but whose reply
                                            is a 500, as when the answer is lost on the way
  extra_output_lines                        raw lines appended to the output/results file
  clock                                     the server's time (epoch seconds)
Observations:
  submissions   one dict per created batch: id, created_at, metadata (OpenAI),
                lines (the parsed request lines: custom_id and body/params)
  polls         status requests for single batches, over all batches
  downloads     result/output/error file downloads
  request_log   one dict per HTTP request: method, path, query, headers, status
"""

from __future__ import annotations

import abc
import contextlib
import datetime as dt
import email.parser
import email.policy
import json
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

AnswerFn = Callable[[str, dict[str, Any]], str]


class FakeAnswerError(Exception):
    """Raised by an `answer` function: this request's answer is an error with this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Refused(Exception):
    """The request is refused with this status and error body."""

    def __init__(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body
        self.headers = headers or {}


def sample_instance(schema: Any, seed: str) -> Any:
    """A small value valid for `schema` (the subset of JSON Schema jobs use), varied by `seed`."""
    if not isinstance(schema, dict):
        return seed
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        values = schema["enum"]
        return values[zlib.crc32(seed.encode()) % len(values)]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return sample_instance(schema[key][0], seed)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        return {name: sample_instance(sub, seed) for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [sample_instance(schema.get("items", {}), seed) for _ in range(int(schema.get("minItems", 1)))]
    if kind == "integer":
        return int(schema.get("minimum", 0))
    if kind == "number":
        return float(schema.get("minimum", 0.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = seed[: int(schema.get("maxLength", 1 << 30))]
    return text.ljust(int(schema.get("minLength", 0)), "x")


def _now_rfc3339(when: float) -> str:
    return dt.datetime.fromtimestamp(when, dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _FakeBatchServer(abc.ABC):
    """What both fakes share: the HTTP server, the log, the knobs and the request loop."""

    api_key = "test-key"

    def __init__(self, answer: AnswerFn | None = None) -> None:
        self.answer: AnswerFn = answer or self.default_answer
        self.duplicate_answer: AnswerFn | None = None
        self.expire_ids: set[str] = set()
        self.error_ids: set[str] = set()
        self.duplicate_ids: set[str] = set()
        self.fail_batch = False
        self.complete_after_polls = 0
        self.fail_next: list[int] = []
        self.retry_after = "0"
        self.served_model: str | None = None
        self.fail_downloads: list[int] = []
        self.drop_create_replies = 0
        self.extra_output_lines: list[str] = []
        self.clock: Callable[[], float] = time.time
        self.submissions: list[dict[str, Any]] = []
        self.polls = 0
        self.downloads = 0
        self.request_log: list[dict[str, Any]] = []
        self.lock = threading.RLock()
        self._polls_of: dict[str, int] = {}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name=type(self).__name__,
                                        daemon=True)

    # --- what the subclasses provide ---------------------------------------------------

    @abc.abstractmethod
    def route(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
              body: bytes) -> tuple[int, Any, dict[str, str]]:
        """Answers one request: (status, JSON body or raw bytes, extra headers)."""

    @abc.abstractmethod
    def check_auth(self, headers: dict[str, str]) -> None:
        """Raises _Refused (401) unless the request carries the key the way the API wants it."""

    @abc.abstractmethod
    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        """The API's error body for an error of this kind."""

    @abc.abstractmethod
    def schema_of(self, body: dict[str, Any]) -> Any:
        """The JSON Schema a request asks its answer to follow."""

    # --- shared ------------------------------------------------------------------------

    @property
    def root(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def default_answer(self, custom_id: str, body: dict[str, Any]) -> str:
        return json.dumps(sample_instance(self.schema_of(body), custom_id))

    def second_answer(self, custom_id: str, body: dict[str, Any]) -> str:
        if self.duplicate_answer is not None:
            return self.duplicate_answer(custom_id, body)
        return self.answer(f"{custom_id}/again", body)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def reply_lost(self) -> None:
        with self.lock:
            if self.drop_create_replies <= 0:
                return
            self.drop_create_replies -= 1
        raise _Refused(500, self.error_body("api_error", "the reply was lost (fake)"))

    def count_download(self) -> None:
        with self.lock:
            self.downloads += 1
            status = self.fail_downloads.pop(0) if self.fail_downloads else None
        if status is not None:
            raise _Refused(status, self.error_body("api_error", f"scripted {status}"), {"Retry-After": "0"})

    def count_poll(self, batch_id: str) -> int:
        with self.lock:
            self.polls += 1
            self._polls_of[batch_id] = self._polls_of.get(batch_id, 0) + 1
            return self._polls_of[batch_id]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                entry: dict[str, Any] = {"method": method, "path": parts.path, "query": parts.query,
                                         "headers": headers, "status": None}
                with fake.lock:
                    fake.request_log.append(entry)
                    scripted = fake.fail_next.pop(0) if fake.fail_next else None
                try:
                    if scripted is not None:
                        extra = {"Retry-After": fake.retry_after} if scripted == 429 else {}
                        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(scripted, "api_error")
                        raise _Refused(scripted, fake.error_body(kind, f"scripted {scripted}"), extra)
                    fake.check_auth(headers)
                    status, payload, extra = fake.route(method, parts.path, parse_qs(parts.query), headers, body)
                except _Refused as exc:
                    status, payload, extra = exc.status, exc.body, exc.headers
                except Exception as exc:  # a bug in the fake: say so instead of hanging the client
                    status, payload, extra = 500, fake.error_body("api_error", f"fake crashed: {exc!r}"), {}
                entry["status"] = status
                if isinstance(payload, bytes):
                    data, content_type = payload, "application/octet-stream"
                else:
                    data, content_type = json.dumps(payload).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for key, value in extra.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        return Handler


def _json_body(fake: _FakeBatchServer, body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError:
        raise _Refused(400, fake.error_body("invalid_request_error", "the body is not valid JSON")) from None
    if not isinstance(data, dict):
        raise _Refused(400, fake.error_body("invalid_request_error", "the body must be a JSON object"))
    return data


# --- OpenAI ------------------------------------------------------------------------------

class FakeOpenAIBatch(_FakeBatchServer):
    """The OpenAI Files and Batch endpoints under /v1."""

    endpoints = ("/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/completions")

    def __init__(self, answer: AnswerFn | None = None) -> None:
        super().__init__(answer)
        self.batch_status_on_end = "completed"
        self.files: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self._order: list[str] = []

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def check_auth(self, headers: dict[str, str]) -> None:
        if headers.get("authorization") != f"Bearer {self.api_key}":
            raise _Refused(401, {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                           "param": None, "code": "invalid_api_key"}})

    def schema_of(self, body: dict[str, Any]) -> Any:
        return ((body.get("response_format") or {}).get("json_schema") or {}).get("schema") or {}

    def bad(self, message: str) -> _Refused:
        return _Refused(400, self.error_body("invalid_request_error", message))

    def route(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
              body: bytes) -> tuple[int, Any, dict[str, str]]:
        if method == "POST" and path == "/v1/files":
            return 200, self.upload(headers, body), {}
        if method == "POST" and path == "/v1/batches":
            return 200, self.create(_json_body(self, body)), {}
        if method == "GET" and path == "/v1/batches":
            return 200, self.list(query), {}
        match = re.fullmatch(r"/v1/batches/([^/]+)", path)
        if method == "GET" and match:
            batch = self.batches.get(match.group(1))
            if batch is None:
                raise _Refused(404, self.error_body("invalid_request_error", f"No batch found with id "
                                                                             f"'{match.group(1)}'."))
            self.count_poll(batch["id"])
            return 200, self.advance(batch), {}
        match = re.fullmatch(r"/v1/files/([^/]+)/content", path)
        if method == "GET" and match:
            stored = self.files.get(match.group(1))
            if stored is None:
                raise _Refused(404, self.error_body("invalid_request_error", "No such File object"))
            self.count_download()
            return 200, stored["content"], {}
        raise _Refused(404, self.error_body("invalid_request_error", f"Unknown request URL: {method} {path}"))

    def upload(self, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        content_type = headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise self.bad("a file upload must be multipart/form-data")
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            f"Content-Type: {content_type}\r\n\r\n".encode() + body)
        fields: dict[str, Any] = {}
        filename = None
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if part.get_filename():
                filename = part.get_filename()
            fields[str(name)] = part.get_payload(decode=True)
        if fields.get("purpose") != b"batch":
            raise self.bad(f"purpose must be 'batch', not {fields.get('purpose')!r}")
        if "file" not in fields or not filename:
            raise self.bad("the upload has no 'file' part with a filename")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        content = fields["file"]
        with self.lock:
            self.files[file_id] = {"id": file_id, "purpose": "batch", "filename": filename, "content": content}
        return {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(self.clock()),
                "filename": filename, "purpose": "batch", "status": "processed"}

    def parse_lines(self, content: bytes, endpoint: str) -> list[dict[str, Any]]:
        lines: list[dict[str, Any]] = []
        seen: set[str] = set()
        for number, raw in enumerate(content.decode("utf-8").splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                raise self.bad(f"line {number} of the input file is not JSON") from None
            missing = [k for k in ("custom_id", "method", "url", "body") if k not in line]
            if missing:
                raise self.bad(f"line {number} lacks {', '.join(missing)}")
            custom_id = line["custom_id"]
            if not isinstance(custom_id, str) or not custom_id:
                raise self.bad(f"line {number}: custom_id must be a non-empty string")
            if custom_id in seen:
                raise self.bad(f"line {number}: duplicate custom_id {custom_id!r}")
            seen.add(custom_id)
            if line["method"] != "POST":
                raise self.bad(f"line {number}: method must be POST")
            if line["url"] != endpoint:
                raise self.bad(f"line {number}: url {line['url']!r} is not the batch's endpoint {endpoint!r}")
            body = line["body"]
            if not isinstance(body, dict) or not body.get("model") or not body.get("messages"):
                raise self.bad(f"line {number}: body needs model and messages")
            lines.append(line)
        if not lines:
            raise self.bad("the input file has no requests")
        return lines

    def create(self, data: dict[str, Any]) -> dict[str, Any]:
        for key in ("input_file_id", "endpoint", "completion_window"):
            if key not in data:
                raise self.bad(f"Missing required parameter: '{key}'.")
        if data["endpoint"] not in self.endpoints:
            raise self.bad(f"endpoint {data['endpoint']!r} is not supported")
        if data["completion_window"] != "24h":
            raise self.bad("completion_window must be '24h'")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict) or len(metadata) > 16 or any(
                not isinstance(k, str) or not isinstance(v, str) or len(k) > 64 or len(v) > 512
                for k, v in metadata.items()):
            raise self.bad("metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters")
        stored = self.files.get(data["input_file_id"])
        if stored is None or stored["purpose"] != "batch":
            raise self.bad(f"input_file_id {data['input_file_id']!r} is not an uploaded batch file")
        lines = self.parse_lines(stored["content"], data["endpoint"])
        now = int(self.clock())
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        batch: dict[str, Any] = {
            "id": batch_id, "object": "batch", "endpoint": data["endpoint"], "errors": None,
            "input_file_id": data["input_file_id"], "completion_window": "24h", "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + 86400, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
        }
        with self.lock:
            self.batches[batch_id] = batch
            self._order.append(batch_id)
            self.submissions.append({"id": batch_id, "created_at": now, "metadata": metadata, "lines": lines,
                                     "input_file_id": data["input_file_id"]})
        self.reply_lost()
        return dict(batch)

    def _lines_of(self, batch_id: str) -> list[dict[str, Any]]:
        return next(s["lines"] for s in self.submissions if s["id"] == batch_id)

    def advance(self, batch: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if batch["status"] in ("completed", "expired", "failed", "cancelled"):
                return dict(batch)
            now = int(self.clock())
            total = len(self._lines_of(batch["id"]))
            if self.fail_batch:
                batch.update(status="failed", failed_at=now, errors={"object": "list", "data": [
                    {"code": "invalid_request", "message": "The model `nope` does not exist.", "param": "body.model",
                     "line": 1}]})
                return dict(batch)
            if self._polls_of[batch["id"]] <= self.complete_after_polls:
                batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or now,
                             request_counts={"total": total, "completed": 0, "failed": 0})
                return dict(batch)
            self.finish(batch, now)
            return dict(batch)

    def _line_id(self) -> str:
        return f"batch_req_{uuid.uuid4().hex[:24]}"

    def _completion(self, custom_id: str, body: dict[str, Any], text: str) -> dict[str, Any]:
        prompt = json.dumps(body.get("messages"))
        return {"id": self._line_id(), "custom_id": custom_id, "response": {
            "status_code": 200, "request_id": uuid.uuid4().hex, "body": {
                "id": f"chatcmpl-{uuid.uuid4().hex[:20]}", "object": "chat.completion", "created": int(self.clock()),
                "model": self.served_model or body["model"], "system_fingerprint": "fp_fake",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": None, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt) // 4 + 1, "completion_tokens": len(text) // 4 + 1,
                          "total_tokens": len(prompt) // 4 + len(text) // 4 + 2}}},
            "error": None}

    def _failure(self, custom_id: str, status: int, kind: str, message: str) -> dict[str, Any]:
        return {"id": self._line_id(), "custom_id": custom_id, "response": {
            "status_code": status, "request_id": uuid.uuid4().hex,
            "body": {"error": {"message": message, "type": kind, "param": None, "code": None}}}, "error": None}

    def finish(self, batch: dict[str, Any], now: int) -> None:
        output: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for line in self._lines_of(batch["id"]):
            custom_id, body = line["custom_id"], line["body"]
            if custom_id in self.expire_ids:
                errors.append({"id": self._line_id(), "custom_id": custom_id, "response": None, "error": {
                    "code": "batch_expired",
                    "message": "This request could not be executed before the completion window expired."}})
                continue
            if custom_id in self.error_ids:
                errors.append(self._failure(custom_id, 500, "server_error",
                                            "The server had an error while processing your request."))
                continue
            try:
                output.append(self._completion(custom_id, body, self.answer(custom_id, body)))
            except FakeAnswerError as exc:
                errors.append(self._failure(custom_id, exc.status, "invalid_request_error", str(exc)))
                continue
            if custom_id in self.duplicate_ids:
                output.append(self._completion(custom_id, body, self.second_answer(custom_id, body)))
        ids = {}
        for name, lines in (("output", output), ("error", errors)):
            extra = self.extra_output_lines if name == "output" else []
            if lines or extra:
                file_id = f"file-{uuid.uuid4().hex[:24]}"
                content = "".join([json.dumps(x) + "\n" for x in lines] + [x + "\n" for x in extra]).encode()
                self.files[file_id] = {"id": file_id, "purpose": f"batch_{name}", "filename": f"{name}.jsonl",
                                       "content": content}
                ids[name] = file_id
        status = self.batch_status_on_end
        answered = len({x["custom_id"] for x in output})
        batch.update(status=status, output_file_id=ids.get("output"), error_file_id=ids.get("error"),
                     in_progress_at=batch["in_progress_at"] or now, finalizing_at=now,
                     request_counts={"total": answered + len(errors), "completed": answered, "failed": len(errors)},
                     **{"completed_at" if status == "completed" else "expired_at": now})

    def list(self, query: dict[str, list[str]]) -> dict[str, Any]:
        limit = int(query.get("limit", ["20"])[0])
        if not 1 <= limit <= 100:
            raise self.bad("limit must be between 1 and 100")
        with self.lock:
            newest_first = [dict(self.batches[i]) for i in reversed(self._order)]
        after = query.get("after", [None])[0]
        if after is not None:
            ids = [b["id"] for b in newest_first]
            if after not in ids:
                raise self.bad(f"after: no batch {after!r}")
            newest_first = newest_first[ids.index(after) + 1:]
        page = newest_first[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(newest_first) > limit}


# --- Anthropic ---------------------------------------------------------------------------

_ANTHROPIC_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class FakeAnthropicBatch(_FakeBatchServer):
    """Anthropic's Message Batches endpoints under /v1/messages/batches."""

    def __init__(self, answer: AnswerFn | None = None) -> None:
        super().__init__(answer)
        self.batches: dict[str, dict[str, Any]] = {}
        self.results: dict[str, bytes] = {}
        self._order: list[str] = []

    @property
    def base_url(self) -> str:
        return self.root

    def error_body(self, kind: str, message: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": kind, "message": message}}

    def bad(self, message: str) -> _Refused:
        return _Refused(400, self.error_body("invalid_request_error", message))

    def check_auth(self, headers: dict[str, str]) -> None:
        if headers.get("x-api-key") != self.api_key:
            raise _Refused(401, self.error_body("authentication_error", "invalid x-api-key"))
        if not headers.get("anthropic-version"):
            raise self.bad("anthropic-version: header is required")

    def schema_of(self, body: dict[str, Any]) -> Any:
        choice = (body.get("tool_choice") or {}).get("name")
        tool = next((t for t in body.get("tools") or [] if t.get("name") == choice), None)
        return (tool or {}).get("input_schema") or {}

    def route(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
              body: bytes) -> tuple[int, Any, dict[str, str]]:
        if path == "/v1/messages/batches":
            if method == "POST":
                return 200, self.create(_json_body(self, body)), {}
            return 200, self.list(query), {}
        match = re.fullmatch(r"/v1/messages/batches/([^/]+)(/results)?", path)
        if method == "GET" and match:
            batch = self.batches.get(match.group(1))
            if batch is None:
                raise _Refused(404, self.error_body("not_found_error", f"no batch {match.group(1)!r}"))
            if match.group(2):
                if batch["processing_status"] != "ended":
                    raise self.bad("results are available once processing has ended")
                self.count_download()
                return 200, self.results[batch["id"]], {}
            self.count_poll(batch["id"])
            return 200, self.advance(batch), {}
        raise _Refused(404, self.error_body("not_found_error", f"{method} {path} does not exist"))

    def check_params(self, number: int, params: Any) -> None:
        if not isinstance(params, dict):
            raise self.bad(f"requests.{number}.params: must be an object")
        if not isinstance(params.get("model"), str) or not params["model"]:
            raise self.bad(f"requests.{number}.params.model: Field required")
        if not isinstance(params.get("max_tokens"), int) or params["max_tokens"] < 1:
            raise self.bad(f"requests.{number}.params.max_tokens: Field required")
        messages = params.get("messages")
        if not isinstance(messages, list) or not messages or any(
                not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m
                for m in messages):
            raise self.bad(f"requests.{number}.params.messages: a list of role/content messages")
        temperature = params.get("temperature")
        if temperature is not None and not 0 <= temperature <= 1:
            raise self.bad(f"requests.{number}.params.temperature: must be between 0 and 1")
        tools = params.get("tools") or []
        names = set()
        for tool in tools:
            if not tool.get("name") or not isinstance(tool.get("input_schema"), dict) \
                    or tool["input_schema"].get("type") != "object":
                raise self.bad(f"requests.{number}.params.tools: each tool needs a name and an object input_schema")
            names.add(tool["name"])
        choice = params.get("tool_choice")
        if choice is not None:
            if choice.get("type") not in ("auto", "any", "tool", "none"):
                raise self.bad(f"requests.{number}.params.tool_choice.type: unknown")
            if choice.get("type") == "tool" and choice.get("name") not in names:
                raise self.bad(f"requests.{number}.params.tool_choice: tool {choice.get('name')!r} not in tools")

    def create(self, data: dict[str, Any]) -> dict[str, Any]:
        requests = data.get("requests")
        if not isinstance(requests, list) or not requests:
            raise self.bad("requests: must be a non-empty list")
        seen: set[str] = set()
        for number, request in enumerate(requests):
            if not isinstance(request, dict) or set(request) != {"custom_id", "params"}:
                raise self.bad(f"requests.{number}: must have exactly custom_id and params")
            custom_id = request["custom_id"]
            if not isinstance(custom_id, str) or not _ANTHROPIC_CUSTOM_ID.fullmatch(custom_id):
                raise self.bad(f"requests.{number}.custom_id: String should match pattern "
                               f"'^[a-zA-Z0-9_-]{{1,64}}$'")
            if custom_id in seen:
                raise self.bad(f"requests.{number}.custom_id: duplicate {custom_id!r}")
            seen.add(custom_id)
            self.check_params(number, request["params"])
        if self.fail_batch:
            raise self.bad("the batch was refused")
        now = self.clock()
        batch_id = f"msgbatch_{uuid.uuid4().hex[:24]}"
        batch: dict[str, Any] = {
            "id": batch_id, "type": "message_batch", "processing_status": "in_progress",
            "request_counts": {"processing": len(requests), "succeeded": 0, "errored": 0, "canceled": 0,
                               "expired": 0},
            "ended_at": None, "created_at": _now_rfc3339(now), "expires_at": _now_rfc3339(now + 86400),
            "archived_at": None, "cancel_initiated_at": None, "results_url": None,
        }
        with self.lock:
            self.batches[batch_id] = batch
            self._order.append(batch_id)
            self.submissions.append({"id": batch_id, "created_at": batch["created_at"], "lines": requests})
        self.reply_lost()
        return dict(batch)

    def advance(self, batch: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if batch["processing_status"] == "ended" or \
                    self._polls_of[batch["id"]] <= self.complete_after_polls:
                return dict(batch)
            self.finish(batch)
            return dict(batch)

    def _message(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        try:
            tool_input = json.loads(text)
        except ValueError:
            tool_input = None
        if isinstance(tool_input, dict) and body.get("tools"):
            content: list[dict[str, Any]] = [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                              "name": body["tools"][0]["name"], "input": tool_input}]
            stop = "tool_use"
        else:
            content, stop = [{"type": "text", "text": text}], "end_turn"
        prompt = json.dumps(body.get("messages"))
        return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                "model": self.served_model or body["model"], "content": content, "stop_reason": stop,
                "stop_sequence": None, "usage": {"input_tokens": len(prompt) // 4 + 1,
                                                 "output_tokens": len(text) // 4 + 1}}

    def finish(self, batch: dict[str, Any]) -> None:
        lines: list[dict[str, Any]] = []
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for request in next(s["lines"] for s in self.submissions if s["id"] == batch["id"]):
            custom_id, params = request["custom_id"], request["params"]
            if custom_id in self.expire_ids:
                lines.append({"custom_id": custom_id, "result": {"type": "expired"}})
                counts["expired"] += 1
                continue
            if custom_id in self.error_ids:
                lines.append({"custom_id": custom_id, "result": {"type": "errored", "error": {
                    "type": "error", "error": {"type": "invalid_request_error", "message": "bad request (fake)"}}}})
                counts["errored"] += 1
                continue
            try:
                text = self.answer(custom_id, params)
            except FakeAnswerError as exc:
                lines.append({"custom_id": custom_id, "result": {"type": "errored", "error": {
                    "type": "error", "error": {"type": "invalid_request_error", "message": str(exc)}}}})
                counts["errored"] += 1
                continue
            lines.append({"custom_id": custom_id, "result": {"type": "succeeded",
                                                             "message": self._message(params, text)}})
            counts["succeeded"] += 1
            if custom_id in self.duplicate_ids:
                lines.append({"custom_id": custom_id, "result": {
                    "type": "succeeded", "message": self._message(params, self.second_answer(custom_id, params))}})
        self.results[batch["id"]] = "".join([json.dumps(x) + "\n" for x in lines]
                                            + [x + "\n" for x in self.extra_output_lines]).encode()
        batch.update(processing_status="ended", ended_at=_now_rfc3339(self.clock()), request_counts=counts,
                     results_url=f"{self.base_url}/v1/messages/batches/{batch['id']}/results")

    def list(self, query: dict[str, list[str]]) -> dict[str, Any]:
        limit = int(query.get("limit", ["20"])[0])
        if not 1 <= limit <= 1000:
            raise self.bad("limit: must be between 1 and 1000")
        with self.lock:
            newest_first = [dict(self.batches[i]) for i in reversed(self._order)]
        after = query.get("after_id", [None])[0]
        if after is not None:
            ids = [b["id"] for b in newest_first]
            if after not in ids:
                raise self.bad(f"after_id: no batch {after!r}")
            newest_first = newest_first[ids.index(after) + 1:]
        page = newest_first[:limit]
        return {"data": page, "has_more": len(newest_first) > limit,
                "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


@contextlib.contextmanager
def openai_batch_server(answer: AnswerFn | None = None) -> Iterator[FakeOpenAIBatch]:
    server = FakeOpenAIBatch(answer)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def anthropic_batch_server(answer: AnswerFn | None = None) -> Iterator[FakeAnthropicBatch]:
    server = FakeAnthropicBatch(answer)
    server.start()
    try:
        yield server
    finally:
        server.stop()
