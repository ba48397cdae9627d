"""The synthetic engine: deterministic, costs a set time per record, injects faults.

It exists for tests, benchmarks and fault drills. Its output is a valid
instance of the job's schema derived from the record's text, so a pipeline
run over it exercises validation like a real model would. Options:

- ``seconds_per_record``, ``seconds_per_token``: the time one record costs
  (the token part counts output tokens). The environment variable
  ``BATCHLINE_SYNTHETIC_SLOWDOWN`` (a factor, default 1) slows one worker's
  engine down without changing the job, as a slow or shared machine would:
  for tests, drills and benchmarks of the scheduler.
- ``chars_per_token``: its tokenizer (default 4 characters per token).
- ``crash_on``, ``error_on``, ``invalid_on``, ``hang_on``: record ids that make
  the engine process die (SIGKILL, as a segfault or the OOM killer would),
  fail with a per-record error, return output that fails the schema, or never
  return.
- ``truncate_on``: record ids whose output is cut off as at ``decoding.max_tokens``
  (its first half, finish reason ``length``), as a model that repeats itself
  until the limit is.
- ``call_log``: a file to which every record id the engine is asked about is
  appended, one per line, so tests can count how often each was computed.
- ``fail_load``: raise a fatal error when loading (a broken model).
- ``load_seconds``: how long loading takes (a large model).
- ``stderr_message``: written to file descriptor 2 while loading, as a native
  library prints (tests that the worker's logs carry the child's stderr).

Decoding: ``decoding.stop`` cuts the output before the first stop sequence in
it, as a model's output is cut; the penalties are accepted and change nothing,
as temperature does not: the output is derived from the text, not sampled.

With a ``model.path``, loading checks the weights there against ``model.digest``
as a real engine's load does (the fleet tests give it weights in object storage);
the outputs do not depend on them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from collections.abc import Iterator, Mapping
from typing import Any

from batchline.engines.base import EngineConfig, EngineOutcome, RequestSource, one_at_a_time
from batchline.engines.decoding import cut_at_stop
from batchline.errors import EngineFatal

SLOWDOWN_ENV = "BATCHLINE_SYNTHETIC_SLOWDOWN"


class SyntheticEngine:
    def __init__(self, config: EngineConfig) -> None:
        opts = dict(config.model.options)
        self.model = config.model
        self.schema = config.output_schema
        self.stop = config.decoding.stop
        slowdown = float(os.environ.get(SLOWDOWN_ENV, "1"))
        self.seconds_per_record = float(opts.get("seconds_per_record", 0.0)) * slowdown
        self.seconds_per_token = float(opts.get("seconds_per_token", 0.0)) * slowdown
        self.chars_per_token = float(opts.get("chars_per_token", 4.0))
        self.crash_on = {str(x) for x in opts.get("crash_on", ())}
        self.error_on = {str(x) for x in opts.get("error_on", ())}
        self.invalid_on = {str(x) for x in opts.get("invalid_on", ())}
        self.hang_on = {str(x) for x in opts.get("hang_on", ())}
        self.truncate_on = {str(x) for x in opts.get("truncate_on", ())}
        self.call_log = opts.get("call_log")
        self.fail_load = bool(opts.get("fail_load", False))
        self.load_seconds = float(opts.get("load_seconds", 0.0))
        self.stderr_message = opts.get("stderr_message")
        self._log_fd: int | None = None

    def load(self) -> None:
        if self.model.path is not None:
            from batchline.digests import verify_weights
            from batchline.engines.models import resolve_model_path

            verify_weights(resolve_model_path(self.model.path, None), self.model.digest)
        if self.stderr_message:
            os.write(2, str(self.stderr_message).encode() + b"\n")
        time.sleep(self.load_seconds)
        if self.fail_load:
            raise EngineFatal("synthetic engine told to fail while loading (fail_load)")
        if self.call_log:
            self._log_fd = os.open(self.call_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def count_tokens(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def generate(self, requests: RequestSource) -> Iterator[EngineOutcome]:
        for req in one_at_a_time(requests):
            yield self._one(req.record_id, req.text, req.prompt)

    def _one(self, record_id: str, text: str, prompt: str) -> EngineOutcome:
        if self._log_fd is not None:
            os.write(self._log_fd, f"{record_id}\n".encode())
        if record_id in self.crash_on:
            os.kill(os.getpid(), signal.SIGKILL)
        if record_id in self.hang_on:
            while True:
                time.sleep(3600)
        output = json.dumps(synthetic_instance(self.schema, text), separators=(",", ":"))
        if record_id in self.invalid_on:
            output = json.dumps({"synthetic_invalid_output": True})
        output, _ = cut_at_stop(output, self.stop)
        finish = "stop"
        if record_id in self.truncate_on:
            output, finish = output[: len(output) // 2], "length"
        tokens = self.count_tokens(output)
        cost = self.seconds_per_record + self.seconds_per_token * tokens
        if cost > 0:
            time.sleep(cost)
        if record_id in self.error_on:
            return EngineOutcome(record_id, error="synthetic engine error (error_on)",
                                 error_kind="engine_error", input_tokens=self.count_tokens(prompt))
        return EngineOutcome(record_id, output=output, input_tokens=self.count_tokens(prompt),
                             output_tokens=tokens, finish_reason=finish)

    def close(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None


def synthetic_instance(schema: Mapping[str, Any], seed_text: str) -> Any:
    """A deterministic value valid against common JSON Schema shapes, chosen by the text."""
    digest = int(hashlib.sha256(seed_text.encode()).hexdigest()[:8], 16)
    return _instance(schema, seed_text, digest)


def _instance(schema: Mapping[str, Any], text: str, digest: int) -> Any:
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        options = list(schema["enum"])
        return options[digest % len(options)]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _instance(schema[key][0], text, digest)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props: Mapping[str, Any] = schema.get("properties", {})
        required = schema.get("required", list(props))
        return {name: _instance(props.get(name, {}), text, digest >> i) for i, name in enumerate(required)}
    if kind == "array":
        n = int(schema.get("minItems", min(1, int(schema.get("maxItems", 1)))))
        return [_instance(schema.get("items", {}), text, digest + i) for i in range(n)]
    if kind == "string":
        lo, hi = int(schema.get("minLength", 0)), int(schema.get("maxLength", 40))
        words = " ".join(text.split())[:hi] or "x"
        return words.ljust(lo, ".")
    if kind == "integer":
        return int(schema.get("minimum", 0))
    if kind == "number":
        return float(schema.get("minimum", 0.0))
    if kind == "boolean":
        return bool(digest & 1)
    return None
