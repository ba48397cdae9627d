"""Hosted batch providers: the port a hosted route's shards are worked through.

A provider takes a shard's cleared records as one batch, and is asked about it
later by whichever worker polls: nothing here holds a lease while the provider
works. `submit` must be safe to follow with `find`: a worker that died between
creating a batch and recording its id must be able to adopt that batch rather
than pay for a second one.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import importlib
import os
import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from batchline.errors import EngineFatal

if TYPE_CHECKING:
    import httpx

    from batchline.engines.base import EngineOutcome, RequestSource
    from batchline.spec import DecodingSpec, ProviderSpec

CUSTOM_ID_PREFIX = "bl-"
# The provider's clock and the store's differ; a batch stamped a little before `since`
# may still be the one a worker created just after it.
CLOCK_SKEW_SECONDS = 120.0


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
    anything (credentials refused, the model does not exist); `refused` when the provider
    answered that this request is wrong (a 4xx other than for credentials), so sending the
    same again would be refused again."""

    def __init__(self, message: str, *, fatal: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal
        self.refused = refused


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


# --- HTTP shared by the hosted providers -----------------------------------------------

# Every 5xx is retried (529 is Anthropic's "overloaded"), and of the 4xx only these, which
# say "not now" rather than "not this": timed out, too early, rate limited.
_RETRY_4XX = frozenset({408, 425, 429})
_FATAL_STATUS = frozenset({401, 403})


class RetryableError(ProviderError):
    """One try failed in a way another try may not: a 429, a 5xx, a timeout, a dropped connection."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def server_message(response: httpx.Response) -> str:
    """The error text a server sent, from either API's error body, or the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:300].strip() or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code")
        message = error.get("message") or ""
        return f"{kind}: {message}" if kind else str(message)
    return str(body)[:300]


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:  # the other form the header may take: an HTTP date
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class ProviderHttp:
    """JSON over HTTP with the retry policy both hosted APIs need.

    429, 5xx, timeouts and dropped connections are retried with exponential backoff and
    jitter, honouring Retry-After; 401/403 are fatal (every later call would fail the
    same way); any other 4xx is a ProviderError carrying the server's message. The
    credentials go on each request rather than on the client, so a client passed in
    (tests, a shared pool) works as it is.
    """

    def __init__(self, api: str, base_url: str, headers: Mapping[str, str], *,
                 client: httpx.Client | None = None, timeout: float = 120.0, max_tries: int = 5,
                 backoff_seconds: float = 0.5, max_backoff_seconds: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        # Imported here so that the port (and the worker that imports it) does not need httpx.
        self._httpx: Any = importlib.import_module("httpx")
        self.api = api
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers)
        self._owns_client = client is None
        self.client: httpx.Client = client if client is not None else self._httpx.Client(
            timeout=self._httpx.Timeout(timeout, connect=min(timeout, 10.0)))
        self.max_tries = max(1, max_tries)
        self.backoff = backoff_seconds
        self.max_backoff = max_backoff_seconds
        self.sleep = sleep
        self.retries = 0  # how many tries were repeated, for reports and tests

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}{path}"

    def delay(self, attempt: int, hint: float | None) -> float:
        if hint is not None:
            return min(hint, self.max_backoff)
        return min(self.max_backoff, self.backoff * 2.0 ** attempt) * random.uniform(0.5, 1.0)

    def _check(self, method: str, url: str, response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        where = f"{self.api} {method} {url}"
        if status in _FATAL_STATUS:
            raise ProviderError(f"{where}: HTTP {status}, credentials refused: {server_message(response)}",
                                fatal=True)
        if status >= 500 or status in _RETRY_4XX:
            raise RetryableError(f"{where}: HTTP {status}: {server_message(response)}", _retry_after(response))
        raise ProviderError(f"{where}: HTTP {status}: {server_message(response)}", refused=True)

    def attempt(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One try, no retry: the caller decides (creating a batch twice costs money)."""
        url = self.url(path)
        headers = {**self.headers, **kwargs.pop("headers", {})}
        try:
            response = self.client.request(method, url, headers=headers, **kwargs)
        except self._httpx.TransportError as exc:  # timeouts, refused and dropped connections
            raise RetryableError(f"{self.api} {method} {url}: {type(exc).__name__}: {exc}") from exc
        self._check(method, url, response)
        return response

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._retrying(method, path, kwargs, None)
        assert not isinstance(response, SubmittedBatch)
        return response

    def create(self, method: str, path: str, find: Callable[[], SubmittedBatch | None],
               **kwargs: Any) -> httpx.Response | SubmittedBatch:
        """Creates a batch, retried like any call, except that a try that timed out or got
        a 5xx may still have made the batch: `find` looks for it before the next try, and
        the batch it finds is the answer, or the shard would be paid for twice."""
        return self._retrying(method, path, kwargs, find)

    def _retrying(self, method: str, path: str, kwargs: dict[str, Any],
                  recover: Callable[[], SubmittedBatch | None] | None) -> httpx.Response | SubmittedBatch:
        for attempt in range(self.max_tries):
            try:
                return self.attempt(method, path, **dict(kwargs))
            except RetryableError as exc:
                found = recover() if recover is not None else None
                if found is not None:
                    return found
                self._back_off(attempt, exc)
        raise AssertionError("unreachable")

    def _back_off(self, attempt: int, exc: RetryableError) -> None:
        """Waits before the next try, or gives up after the last one."""
        if attempt + 1 >= self.max_tries:
            raise ProviderError(f"{exc} (gave up after {self.max_tries} tries)") from exc
        self.retries += 1
        self.sleep(self.delay(attempt, exc.retry_after))

    def recent(self, path: str, *, after_param: str, page_size: int, since: float,
               created_at: Callable[[dict[str, Any]], float]) -> Iterator[dict[str, Any]]:
        """The batches a list endpoint gives (newest first, a page at a time) that were
        created at or after `since`, less the clock skew between the provider and us."""
        after: str | None = None
        oldest_wanted = since - CLOCK_SKEW_SECONDS
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if after:
                params[after_param] = after
            page = self.json("GET", path, params=params)
            data = [b for b in page.get("data") or [] if isinstance(b, dict)]
            yield from (b for b in data if created_at(b) >= oldest_wanted)
            # Once a page reaches back past `since`, older pages cannot hold a match.
            oldest = min((created_at(b) for b in data), default=0.0)
            if not page.get("has_more") or not data or oldest < oldest_wanted:
                return
            after = page.get("last_id") or data[-1].get("id")

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.call(method, path, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise ProviderError(f"{self.api} {method} {self.url(path)}: the answer is not JSON: "
                                f"{response.text[:200]!r}") from exc

    def lines(self, path: str) -> Iterator[str]:
        """The lines of a (large) JSONL download as they arrive. Opening it is retried; a
        download that breaks off half way is a ProviderError, and the caller reads it all
        again (answers are put-if-absent, so reading one twice does no harm)."""
        url = self.url(path)
        for attempt in range(self.max_tries):
            try:
                request = self.client.build_request("GET", url, headers=self.headers)
                response = self.client.send(request, stream=True)
            except self._httpx.TransportError as exc:
                failure = RetryableError(f"{self.api} GET {url}: {type(exc).__name__}: {exc}")
            else:
                try:
                    if response.status_code >= 400:
                        response.read()
                    self._check("GET", url, response)
                except RetryableError as exc:
                    response.close()
                    failure = exc
                except BaseException:
                    response.close()
                    raise
                else:
                    try:
                        yield from response.iter_lines()
                    except self._httpx.TransportError as exc:
                        raise ProviderError(f"{self.api} GET {url}: the download broke off: {exc}") from exc
                    finally:
                        response.close()
                    return
            self._back_off(attempt, failure)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


def with_options(body: dict[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """A request body with the route's options merged in; an option set to null removes
    that field (reasoning models refuse `temperature` and `top_p`)."""
    for key, value in options.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


class BatchClient:
    """What both hosted APIs' clients hold: the route, the job's decoding and schema, and
    the HTTP client with its retry policy."""

    def __init__(self, spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                 job_name: str, http: ProviderHttp) -> None:
        self.spec = spec
        self.decoding = decoding
        self.output_schema = dict(output_schema)
        self.job_name = job_name
        self.http = http
        # Lines of a download that could not be read, kept for the report rather than
        # failing the whole download: the records they belonged to simply stay unanswered.
        self.problems: list[str] = []
        self.page_size = 100  # batches a list request asks for

    def close(self) -> None:
        self.http.close()


def api_key(spec: ProviderSpec, default_env: str) -> str:
    """The key from the environment variable the spec names; missing is fatal, since every
    call would be refused."""
    env = spec.api_key_env or default_env
    key = os.environ.get(env, "").strip()
    if not key:
        raise ProviderError(f"route {spec.route!r} ({spec.api}) needs an API key in the environment "
                            f"variable {env}, which is not set", fatal=True)
    return key


# --- a provider used in-process as an engine ------------------------------------------

class HostedBatchEngine:
    """A `BatchProvider` behind the `Engine` protocol, for running a hosted route in-process
    (benchmarks, tools, small jobs). It takes every request, sends them as one batch, waits
    for the batch to end and then yields the outcomes: nothing streams, because the
    provider answers a batch only once it has ended. The worker does not use this: it
    records the batch id in the shard table and polls without holding a lease."""

    def __init__(self, spec: ProviderSpec, decoding: DecodingSpec, output_schema: Mapping[str, Any],
                 job_name: str, *, provider: BatchProvider | None = None,
                 sleep: Callable[[float], None] = time.sleep, max_poll_failures: int = 5) -> None:
        self.spec = spec
        self.decoding = decoding
        self.output_schema = output_schema
        self.job_name = job_name
        self.provider = provider
        self.sleep = sleep
        self.max_poll_failures = max_poll_failures
        self.last_batch: SubmittedBatch | None = None

    def load(self) -> None:
        # Opening the provider is where a missing key shows: fail here, before any record is taken.
        if self.provider is None:
            from batchline.providers import open_provider

            try:
                self.provider = open_provider(self.spec, self.decoding, self.output_schema, self.job_name)
            except ProviderError as exc:
                raise EngineFatal(str(exc)) from exc

    def count_tokens(self, text: str) -> int:
        # Neither API offers a free tokenizer for batch models; three bytes a token over-counts
        # English text, so the input cap errs on the side of refusing.
        return len(text.encode("utf-8")) // 3 + 1

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        from batchline.engines.base import EngineOutcome

        provider = self.provider
        if provider is None:
            raise EngineFatal("engine used before load()")
        taken = []
        while True:
            chunk = requests.next_batch(1000)
            if not chunk:
                break
            taken.extend(chunk)
        if not taken:
            return
        id_map = custom_id_map([r.record_id for r in taken], provider.acceptable_custom_id)
        custom_of = {record_id: custom for custom, record_id in id_map.items()}
        batch_requests = [BatchRequest(custom_of[r.record_id], r.prompt) for r in taken]
        tag = f"{self.job_name}/in-process/{uuid.uuid4().hex[:12]}"
        try:
            batch = self.last_batch = provider.submit(batch_requests, tag)
        except ProviderError as exc:
            raise EngineFatal(f"the batch was not accepted: {exc}") from exc
        progress = self._wait(provider, batch)
        if progress.error is not None:
            # The batch as a whole was refused (its input, the model): every record would fail alike.
            raise EngineFatal(f"batch {batch.batch_id} {progress.status}: {progress.error}")
        answered: set[str] = set()
        try:
            for answer in provider.answers(batch):
                record_id = id_map.get(answer.custom_id)
                if record_id is None or record_id in answered:
                    continue  # not ours, or a duplicate line: the first answer stands
                answered.add(record_id)
                yield _outcome(record_id, answer)
        except ProviderError as exc:
            raise EngineFatal(f"the answers of batch {batch.batch_id} could not be read: {exc}") from exc
        for r in taken:
            if r.record_id not in answered:
                yield EngineOutcome(record_id=r.record_id, error=f"batch {batch.batch_id} has no answer for it",
                                    error_kind="engine_error")

    def _wait(self, provider: BatchProvider, batch: SubmittedBatch) -> BatchProgress:
        failures = 0
        while True:
            try:
                progress = provider.progress(batch)
                failures = 0
            except ProviderError as exc:
                # The batch is safe at the provider; only a run of failures means it is gone for us.
                failures += 1
                if exc.fatal or failures >= self.max_poll_failures:
                    raise EngineFatal(f"cannot follow batch {batch.batch_id}: {exc}") from exc
            else:
                if progress.ended:
                    return progress
            self.sleep(self.spec.poll_seconds)

    def close(self) -> None:
        if self.provider is not None:
            self.provider.close()


def _outcome(record_id: str, answer: BatchAnswer) -> EngineOutcome:
    # Imported here: the port stays importable from the spec and the store without the engine layer.
    from batchline.engines.base import EngineOutcome

    if answer.kind == "ok":
        return EngineOutcome(record_id=record_id, output=answer.output, input_tokens=answer.input_tokens,
                             output_tokens=answer.output_tokens)
    if answer.kind in ("expired", "canceled"):
        return EngineOutcome(record_id=record_id, error=f"{answer.kind} at the provider", error_kind="engine_error")
    return EngineOutcome(record_id=record_id, error=answer.error or "the provider gave an error",
                         error_kind="engine_error", input_tokens=answer.input_tokens,
                         output_tokens=answer.output_tokens)
