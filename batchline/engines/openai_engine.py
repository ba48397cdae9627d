"""Any OpenAI-compatible server: vLLM's, llama.cpp's, a hosted provider.

``model.path`` is the base URL (``http://host:8000/v1``). Records are sent as
chat completions (or completions) with the job's JSON Schema as the response
format, at most ``concurrency`` at a time, and each outcome is yielded as its
response arrives.

Failures are sorted by whose they are:
  - 429 and 5xx, timeouts and refused connections are retried with exponential
    backoff and jitter (honouring Retry-After); a record still failing after
    ``max_retries`` is that record's error;
  - any other 4xx answers this record's request (bad input, too long): that
    record's error, at once;
  - 401/403 say the credentials are wrong: every record would fail, so it is fatal;
  - when the server has answered nothing successfully for ``unreachable_seconds``
    it is gone: fatal, and the supervisor releases the shard instead of
    charging its records.

Model options (``model.options``), part of the job version: `OPTIONS` below.
Credentials are not: the key is read from the environment variable named by
``api_key_env``.

The job's decoding.frequency_penalty, presence_penalty and stop go in every
request body when set; decoding.repetition_penalty is not part of the OpenAI API
and a job that sets it is refused (batchline.registry).

Conversations (openai-batch input) are sent as their messages with api "chat";
with api "completions" they go as the plain role-tagged prompt, since the
server's chat template is out of reach there.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from batchline.engines.base import EngineConfig, EngineOutcome, EngineRequest, RequestSource
from batchline.errors import EngineFatal
from batchline.registry import EngineOption, EngineOptions

OPTIONS = EngineOptions(
    EngineOption("model", "string", "The served model's name", default_text="the first the server lists"),
    EngineOption("api", "string", "Chat completions, or completions of a rendered prompt", "chat",
                 choices=("chat", "completions")),
    EngineOption("response_format", "string", "json_schema as OpenAI and vLLM take it; json_object for "
                 "llama-cpp-python's server (the schema beside the type); none", "json_schema",
                 choices=("json_schema", "json_object", "none")),
    EngineOption("concurrency", "integer", "Requests in flight at once", 8),
    EngineOption("timeout_seconds", "number", "How long one request may take", 120.0),
    EngineOption("max_retries", "integer", "Retries of a 429, a 5xx, a timeout or a refused connection", 5),
    EngineOption("backoff_seconds", "number", "The first retry's back-off (then doubled, with jitter)", 0.5),
    EngineOption("max_backoff_seconds", "number", "The longest back-off", 30.0),
    EngineOption("unreachable_seconds", "number", "Without one success for this long the server is gone (fatal)",
                 300.0),
    EngineOption("api_key_env", "string", "The environment variable holding the key", "OPENAI_API_KEY"),
    EngineOption("extra_body", "mapping", "Merged into every request body", {}),
)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
FATAL_STATUS = frozenset({401, 403})
# Without a tokenize endpoint, a conservative estimate: English text averages
# about four bytes per token for current tokenizers, so three over-counts.
_BYTES_PER_TOKEN_ESTIMATE = 3


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise EngineFatal(
            "the openai engine needs httpx (install batchline's 'openai' extra)"
        ) from None
    return httpx


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """It asks a server: the rate is the server's answering one worker."""
    return "a server (the rate is the server's, answering one worker)"


class _RecordError(Exception):
    """This record failed; the engine goes on."""


class OpenAIEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if not config.model.path:
            raise EngineFatal("the openai engine needs model.path, the server's base URL")
        self.base_url = config.model.path.rstrip("/")
        opts = dict(config.model.options)
        self.model_name: str | None = opts.get("model")
        # Planning refuses another value already; this holds for an engine built from elsewhere.
        for name in ("api", "response_format"):
            refusal = OPTIONS[name].refusal(OPTIONS.of(opts, name))
            if refusal:
                raise EngineFatal(f"model.options.{name} {refusal}")
        self.api = str(OPTIONS.of(opts, "api"))
        self.response_format = str(OPTIONS.of(opts, "response_format"))
        self.concurrency = max(1, int(OPTIONS.of(opts, "concurrency")))
        self.timeout = float(OPTIONS.of(opts, "timeout_seconds"))
        self.max_retries = int(OPTIONS.of(opts, "max_retries"))
        self.backoff = float(OPTIONS.of(opts, "backoff_seconds"))
        self.max_backoff = float(OPTIONS.of(opts, "max_backoff_seconds"))
        self.unreachable = float(OPTIONS.of(opts, "unreachable_seconds"))
        self.api_key_env = str(OPTIONS.of(opts, "api_key_env"))
        self.extra_body: dict[str, Any] = dict(OPTIONS.of(opts, "extra_body") or {})
        self._client: Any = None
        self._httpx: Any = None
        self._tokenize_url: str | None = None
        self._lock = threading.Lock()
        self._last_success = time.monotonic()
        self._fatal: EngineFatal | None = None
        # Set when generate() ends, so worker threads stop retrying for a consumer that left.
        self._stop = threading.Event()
        self.stats = {"requests": 0, "retries": 0}

    # --- loading -------------------------------------------------------------

    def load(self) -> None:
        # No weights are loaded here: the server owns them, and the model name
        # (an option, so part of the job version) is the identity a job pins.
        httpx = self._httpx = _import_httpx()
        headers = {}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
            limits=httpx.Limits(max_connections=self.concurrency * 2),
        )
        self._last_success = time.monotonic()
        listing = self._send("GET", f"{self.base_url}/models", None)
        served = [str(m.get("id")) for m in (listing or {}).get("data", []) if isinstance(m, dict)]
        if self.model_name is None:
            if not served:
                raise EngineFatal(f"{self.base_url}/models lists no model; set model.options.model")
            self.model_name = served[0]
        elif served and self.model_name not in served:
            raise EngineFatal(
                f"{self.base_url} does not serve model {self.model_name!r} (it serves {', '.join(served)})"
            )
        self._tokenize_url = self._find_tokenizer()

    def _find_tokenizer(self) -> str | None:
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        for url in (f"{root}/tokenize", f"{self.base_url}/extras/tokenize", f"{root}/extras/tokenize"):
            try:
                if self._tokens_from(url, "probe") is not None:
                    return url
            except Exception:
                continue
        return None

    def _tokens_from(self, url: str, text: str) -> int | None:
        # vLLM's /tokenize takes "prompt"; llama-cpp-python's /extras/tokenize takes "input".
        response = self._client.post(url, json={"model": self.model_name, "prompt": text, "input": text})
        if response.status_code != 200:
            return None
        body = response.json()
        if isinstance(body.get("count"), int):
            return int(body["count"])
        if isinstance(body.get("tokens"), list):
            return len(body["tokens"])
        return None

    # --- Engine protocol -----------------------------------------------------

    def count_tokens(self, text: str) -> int:
        if self._tokenize_url is not None:
            count = self._tokens_from(self._tokenize_url, text)
            if count is not None:
                return count
        return math.ceil(len(text.encode("utf-8")) / _BYTES_PER_TOKEN_ESTIMATE)

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        if self._client is None:
            raise EngineFatal("engine used before load()")
        pending: dict[Future[EngineOutcome], EngineRequest] = {}
        exhausted = False
        self._stop.clear()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="openai")
        try:
            while True:
                room = self.concurrency - len(pending)
                if room > 0 and not exhausted:
                    new = requests.poll(room) if pending else requests.next_batch(room)
                    if not new and not pending:
                        exhausted = True
                    for request in new:
                        pending[pool.submit(self.run_one, request)] = request
                if not pending:
                    if exhausted:
                        return
                    continue
                # While more records may come, wake up now and then to take them.
                done, _ = wait(pending, timeout=None if exhausted else 0.05,
                               return_when=FIRST_COMPLETED)
                for future in done:
                    del pending[future]
                    yield future.result()  # run_one raises only EngineFatal
        finally:
            # Requests still in flight are abandoned, not awaited: after a fatal error
            # or a consumer that stopped, their answers have no one to go to.
            self._stop.set()
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- one record ------------------------------------------------------------

    def run_one(self, request: EngineRequest) -> EngineOutcome:
        try:
            body = self._send("POST", self._url(), self._body(request))
            return self._outcome(request, body or {})
        except _RecordError as exc:
            return EngineOutcome(record_id=request.record_id, error=str(exc), error_kind="engine_error")

    def _url(self) -> str:
        return f"{self.base_url}/chat/completions" if self.api == "chat" else f"{self.base_url}/completions"

    def _body(self, request: EngineRequest) -> dict[str, Any]:
        decoding = self.config.decoding
        body: dict[str, Any] = {
            "model": self.model_name,
            "temperature": decoding.temperature,
            "top_p": decoding.top_p,
            "max_tokens": decoding.max_tokens,
            "seed": decoding.seed,
            # frequency_penalty, presence_penalty and stop, where set (repetition_penalty,
            # not in the API, is refused when the job is parsed).
            **decoding.knobs(),
        }
        if self.api == "chat" and request.messages is not None:
            # A conversation goes as it came; the server applies its model's chat template.
            body["messages"] = [dict(m) for m in request.messages]
        elif self.api == "chat":
            # One user message with the whole prompt: the shared prefix stays first,
            # where servers with prefix caching (vLLM, llama.cpp) reuse it.
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        schema = dict(self.config.output_schema)
        if self.response_format == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": True},
            }
        elif self.response_format == "json_object":
            body["response_format"] = {"type": "json_object", "schema": schema}
        body.update(self.extra_body)
        return body

    def _outcome(self, request: EngineRequest, body: dict[str, Any]) -> EngineOutcome:
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        except (KeyError, IndexError, TypeError):
            raise _RecordError(f"unexpected response from the server: {str(body)[:200]}") from None
        usage = body.get("usage") or {}
        input_tokens = usage.get("prompt_tokens")
        output_tokens = usage.get("completion_tokens")
        if choice.get("finish_reason") == "length":
            raise _RecordError(
                f"output reached max_tokens={self.config.decoding.max_tokens} before it was complete: "
                f"{str(text)[:80]!r}..."
            )
        return EngineOutcome(record_id=request.record_id, output=str(text or "").strip(),
                             input_tokens=input_tokens, output_tokens=output_tokens)

    # --- HTTP with retries ---------------------------------------------------------

    def _send(self, method: str, url: str, body: dict[str, Any] | None) -> Any:
        httpx = self._httpx
        last = "no attempt"
        for attempt in range(self.max_retries + 1):
            if self._fatal is not None:
                raise self._fatal
            if self._stop.is_set():
                raise _RecordError("engine stopped before the request was answered")
            if attempt:
                with self._lock:
                    self.stats["retries"] += 1
            try:
                with self._lock:
                    self.stats["requests"] += 1
                response = self._client.request(method, url, json=body)
            except httpx.TimeoutException as exc:
                last = f"timed out after {self.timeout:g}s ({type(exc).__name__})"
                self._check_alive(last)
                self._sleep(attempt, None)
                continue
            except httpx.TransportError as exc:
                last = f"cannot reach {url}: {exc}"
                self._check_alive(last)
                self._sleep(attempt, None)
                continue
            status = response.status_code
            if status < 400:
                with self._lock:
                    self._last_success = time.monotonic()
                try:
                    return response.json()
                except ValueError:
                    raise _RecordError(f"server answered {status} with no JSON") from None
            detail = _detail(response)
            if status in FATAL_STATUS:
                self._fatal = EngineFatal(f"{url} refused the credentials ({status}): {detail}")
                raise self._fatal
            if status in RETRY_STATUS:
                last = f"server answered {status}: {detail}"
                self._check_alive(last)
                self._sleep(attempt, response.headers.get("retry-after"))
                continue
            with self._lock:
                # The server is up and answering; this record's request is what it refuses.
                self._last_success = time.monotonic()
            raise _RecordError(f"server answered {status}: {detail}")
        raise _RecordError(f"gave up after {self.max_retries + 1} attempts: {last}")

    def _check_alive(self, last: str) -> None:
        with self._lock:
            silent = time.monotonic() - self._last_success
        if silent > self.unreachable:
            self._fatal = EngineFatal(
                f"{self.base_url} has not answered successfully for {silent:.0f}s: {last}"
            )
            raise self._fatal

    def _sleep(self, attempt: int, retry_after: str | None) -> None:
        if attempt >= self.max_retries:
            return
        delay = min(self.max_backoff, self.backoff * (2 ** attempt))
        delay *= 0.5 + random.random()  # jitter, so concurrent retries do not arrive together
        if retry_after is not None:
            with contextlib.suppress(ValueError):  # an HTTP date instead of seconds: ignored
                delay = max(delay, min(self.max_backoff, float(retry_after)))
        self._stop.wait(delay)


def _detail(response: Any) -> str:
    try:
        body = response.json()
        if isinstance(body, dict):
            error = body.get("error", body.get("detail", body))
            if isinstance(error, dict):
                error = error.get("message", error)
            return " ".join(str(error).split())[:200]
    except ValueError:
        pass
    return " ".join(response.text.split())[:200]
