"""The OpenAI-compatible engine: retries, per-record errors and fatal conditions
against a scripted server in the test, then against a real llama.cpp server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchline.engines import create_engine
from batchline.engines.base import EngineConfig
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from tests.helpers import free_port
from tests.integration.engines.support import ListSource, make_request

pytest.importorskip("httpx")

SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": ["hardware", "access", "other"]}},
    "required": ["label"],
    "additionalProperties": False,
}
FAST = {"backoff_seconds": 0.01, "max_backoff_seconds": 0.05, "timeout_seconds": 5}


def _config(url: str, **options: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelSpec(engine="openai", path=url, options=options),
        decoding=DecodingSpec(temperature=0.0, max_tokens=32, seed=0),
        output_schema=SCHEMA,
    )


class ScriptedServer:
    """An OpenAI-style server whose answer depends on a word in the prompt.

    RATE: 429 twice, then an answer. FLAKY: 503 once, then an answer.
    BAD: always 400. DENY: 401. Anything else: an answer at once.
    """

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.seen: dict[str, int] = {}
        self.active = 0
        self.max_active = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._reply(200, {"data": [{"id": "fake-model"}]})
                else:
                    self._reply(404, {"error": {"message": "no such path"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    self._reply(404, {"error": {"message": "no such path"}})
                    return
                prompt = body["messages"][0]["content"]
                with server.lock:
                    server.bodies.append(body)
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                    word = next((w for w in ("RATE", "FLAKY", "BAD", "DENY") if w in prompt), "OK")
                    server.seen[word] = server.seen.get(word, 0) + 1
                    count = server.seen[word]
                try:
                    time.sleep(0.02)
                    if word == "RATE" and count <= 2:
                        self._reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
                    elif word == "FLAKY" and count == 1:
                        self._reply(503, {"error": {"message": "overloaded"}})
                    elif word == "BAD":
                        self._reply(400, {"error": {"message": "prompt is too long"}})
                    elif word == "DENY":
                        self._reply(401, {"error": {"message": "invalid api key"}})
                    else:
                        self._reply(200, {
                            "choices": [{"message": {"content": '{"label": "other"}'}, "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 11, "completion_tokens": 5},
                        })
                finally:
                    with server.lock:
                        server.active -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retries_429_and_5xx_and_keeps_4xx_to_its_record() -> None:
    with ScriptedServer() as server:
        engine = create_engine(_config(server.url, concurrency=3, **FAST))
        engine.load()
        texts = ["ok one", "RATE limited", "FLAKY server", "BAD record", "ok two", "ok three", "ok four"]
        source = ListSource(make_request(f"r{i}", "Classify.\n", t) for i, t in enumerate(texts))
        outcomes = {o.record_id: o for o in engine.generate(source)}
        engine.close()

    assert set(outcomes) == {f"r{i}" for i in range(len(texts))}
    assert outcomes["r3"].error_kind == "engine_error"
    assert "400" in (outcomes["r3"].error or "") and "prompt is too long" in (outcomes["r3"].error or "")
    for rid in ("r0", "r1", "r2", "r4", "r5", "r6"):
        assert outcomes[rid].error is None
        assert json.loads(outcomes[rid].output or "") == {"label": "other"}
        assert (outcomes[rid].input_tokens, outcomes[rid].output_tokens) == (11, 5)
    assert server.seen["RATE"] == 3 and server.seen["FLAKY"] == 2 and server.seen["BAD"] == 1
    assert server.max_active <= 3
    body = server.bodies[0]
    assert body["model"] == "fake-model"
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == SCHEMA
    assert body["messages"][0]["content"].startswith("Classify.\n<record>\n")


def test_retries_run_out_into_a_record_error() -> None:
    with ScriptedServer() as server:
        engine = create_engine(_config(server.url, max_retries=1, **FAST))
        engine.load()
        [outcome] = list(engine.generate(ListSource([make_request("r", "p", "RATE")])))
    assert outcome.error_kind == "engine_error"
    assert "429" in (outcome.error or "") and "2 attempts" in (outcome.error or "")


def test_rejected_credentials_are_fatal() -> None:
    with ScriptedServer() as server:
        engine = create_engine(_config(server.url, **FAST))
        engine.load()
        with pytest.raises(EngineFatal, match="401"):
            list(engine.generate(ListSource([make_request("r", "p", "DENY")])))


def test_unknown_model_is_fatal_at_load() -> None:
    with ScriptedServer() as server:
        engine = create_engine(_config(server.url, model="gpt-9", **FAST))
        with pytest.raises(EngineFatal, match="does not serve model 'gpt-9'"):
            engine.load()


def test_unreachable_server_is_fatal_after_the_bound() -> None:
    engine = create_engine(_config(f"http://127.0.0.1:{free_port()}/v1", unreachable_seconds=0.3,
                                   max_retries=100, **FAST))
    started = time.monotonic()
    with pytest.raises(EngineFatal, match="has not answered successfully"):
        engine.load()
    assert time.monotonic() - started < 10


# --- against a real server -------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    pytest.importorskip("llama_cpp.server")
    from batchline.engines.models import GEMMA_PACKAGE, resolve_model_path

    model = resolve_model_path(None, GEMMA_PACKAGE)
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--n_ctx", "2048", "--chat_format", "gemma", "--n_threads", "2"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"llama_cpp.server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("llama_cpp.server did not start within 120 s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.engine
def test_real_llama_cpp_server(llama_server: str) -> None:
    engine = create_engine(_config(llama_server, response_format="json_object", concurrency=2,
                                   timeout_seconds=120))
    engine.load()
    prefix = "Label each IT ticket as hardware, access or other, as JSON.\n"
    texts = ["my laptop screen is broken", "please reset my password", "lunch menu question"]
    requests = [make_request(f"t-{i}", prefix, t) for i, t in enumerate(texts)]
    # Longer than the server's 2048-token context: the server refuses this one record.
    requests.append(make_request("t-huge", prefix, "word " * 3000))
    outcomes = {o.record_id: o for o in engine.generate(ListSource(requests))}
    assert outcomes["t-huge"].error_kind == "engine_error"
    for i in range(len(texts)):
        outcome = outcomes[f"t-{i}"]
        assert outcome.error is None, outcome.error
        jsonschema.validate(json.loads(outcome.output or ""), SCHEMA)
        assert outcome.input_tokens and outcome.output_tokens
    # The server's tokenize endpoint gives exact counts; the plain estimate would be 3x the bytes' third.
    assert 0 < engine.count_tokens("my laptop screen is broken") < 10


def test_the_request_body_carries_the_jobs_penalties_and_stop_sequences() -> None:
    decoding = DecodingSpec(max_tokens=32, frequency_penalty=0.5, presence_penalty=-0.25, stop=("END", "###"))
    with ScriptedServer() as server:
        config = _config(server.url, **FAST)
        engine = create_engine(EngineConfig(model=config.model, decoding=decoding, output_schema=SCHEMA))
        engine.load()
        outcomes = list(engine.generate(ListSource([make_request("r0", "Classify.\n", "ok")])))
        engine.close()
    assert outcomes[0].error is None
    body = server.bodies[0]
    assert (body["frequency_penalty"], body["presence_penalty"], body["stop"]) == (0.5, -0.25, ["END", "###"])
    assert "repetition_penalty" not in body


def test_knobs_left_unset_are_not_sent() -> None:
    with ScriptedServer() as server:
        engine = create_engine(_config(server.url, **FAST))
        engine.load()
        list(engine.generate(ListSource([make_request("r0", "Classify.\n", "ok")])))
        engine.close()
    assert not {"frequency_penalty", "presence_penalty", "stop", "repetition_penalty"} & set(server.bodies[0])
