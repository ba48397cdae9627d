"""The synthetic engine: deterministic, costs a set time per record, injects faults.

It exists for tests, benchmarks and fault drills. Its output is a valid
instance of the job's schema derived from the record's text, so a pipeline
run over it exercises validation like a real model would. Its options are
`OPTIONS` below: the time one record costs, its tokenizer, and fault injection
by record id (the engine process dies as on a segfault or the OOM killer,
fails the record, returns output that fails the schema, never returns, answers it
differently in each engine process (as an engine that is not batch-invariant), or cuts
the output off as at ``decoding.max_tokens``, its first half with finish
reason ``length``, as a model that repeats itself until the limit does). The
environment variable ``BATCHLINE_SYNTHETIC_SLOWDOWN`` (a factor, default 1)
slows one worker's engine down without changing the job, as a slow or shared
machine would: for tests, drills and benchmarks of the scheduler.

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
from pathlib import Path
from typing import Any

from batchline.engines.base import EngineConfig, EngineOutcome, RequestSource, one_at_a_time
from batchline.engines.decoding import cut_at_stop
from batchline.errors import EngineFatal
from batchline.registry import EngineOption, EngineOptions
from batchline.spec import ModelSpec

SLOWDOWN_ENV = "BATCHLINE_SYNTHETIC_SLOWDOWN"

OPTIONS = EngineOptions(
    EngineOption("seconds_per_record", "number", "Seconds each record costs", 0.0),
    EngineOption("seconds_per_token", "number", "Seconds each output token costs, on top", 0.0),
    EngineOption("chars_per_token", "number", "Its tokenizer: characters per token", 4.0),
    EngineOption("crash_on", "record ids", "Records whose call kills the engine process (SIGKILL)", []),
    EngineOption("error_on", "record ids", "Records that fail with a per-record engine error", []),
    EngineOption("invalid_on", "record ids", "Records whose output fails the schema", []),
    EngineOption("hang_on", "record ids", "Records whose call never returns", []),
    EngineOption("truncate_on", "record ids", "Records whose output is cut off as at max_tokens (finish length)",
                 []),
    EngineOption("unstable_on", "record ids", "Records each engine process answers differently (an engine that "
                 "is not batch-invariant: another batch, device or build decodes them otherwise)", []),
    EngineOption("call_log", "string", "A file every record id asked about is appended to, one a line"),
    EngineOption("fail_load", "boolean", "Loading raises a fatal error (a broken model)", False),
    EngineOption("load_seconds", "number", "Seconds loading takes (a large model)", 0.0),
    EngineOption("stderr_message", "string", "Written to file descriptor 2 while loading, as a native library "
                 "prints"),
)


def computes_on(options: Mapping[str, Any], runtime: str | None) -> str:
    """It computes nothing: a set time per record stands in for a model's."""
    return "none (the synthetic engine takes a set time per record)"


class SyntheticEngine:
    def __init__(self, config: EngineConfig) -> None:
        opts = dict(config.model.options)
        self.model = config.model
        self.schema = config.output_schema
        self.stop = config.decoding.stop
        slowdown = float(os.environ.get(SLOWDOWN_ENV, "1"))
        self.seconds_per_record = float(OPTIONS.of(opts, "seconds_per_record")) * slowdown
        self.seconds_per_token = float(OPTIONS.of(opts, "seconds_per_token")) * slowdown
        self.chars_per_token = float(OPTIONS.of(opts, "chars_per_token"))
        self.crash_on = {str(x) for x in OPTIONS.of(opts, "crash_on")}
        self.error_on = {str(x) for x in OPTIONS.of(opts, "error_on")}
        self.invalid_on = {str(x) for x in OPTIONS.of(opts, "invalid_on")}
        self.hang_on = {str(x) for x in OPTIONS.of(opts, "hang_on")}
        self.truncate_on = {str(x) for x in OPTIONS.of(opts, "truncate_on")}
        self.unstable_on = {str(x) for x in OPTIONS.of(opts, "unstable_on")}
        self.call_log = OPTIONS.of(opts, "call_log")
        self.fail_load = bool(OPTIONS.of(opts, "fail_load"))
        self.load_seconds = float(OPTIONS.of(opts, "load_seconds"))
        self.stderr_message = OPTIONS.of(opts, "stderr_message")
        self._log_fd: int | None = None

    @staticmethod
    def local_weights(model: ModelSpec) -> Path | None:
        """The weights it checks (it loads none), when the job names some."""
        from batchline.engines.models import resolve_model_path

        return None if model.path is None else resolve_model_path(model.path, None)

    def load(self) -> None:
        path = self.local_weights(self.model)
        if path is not None:
            from batchline.digests import verify_weights

            verify_weights(path, self.model.digest)
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
        seed = f"{os.getpid()} {text}" if record_id in self.unstable_on else text
        output = json.dumps(synthetic_instance(self.schema, seed), separators=(",", ":"))
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
