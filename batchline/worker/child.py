"""The engine child: loads the engine and streams outcomes for the requests it is sent.

It speaks JSON lines: an `init` message, then `req` messages on stdin; a
`ready` (or `fatal`) message, then one `out` message per request on stdout.
It dies with its supervisor (PR_SET_PDEATHSIG), so a killed worker never leaves
a model holding a GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from batchline.engines import create_engine
from batchline.engines.base import Engine, EngineConfig, EngineOutcome, EngineRequest, chat_prompt
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec, ModelSpec

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the child still exits when its stdin closes


class _Writer:
    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, separators=(",", ":")) + "\n"
        with self.lock:
            self.stream.write(line)
            self.stream.flush()

    def outcome(self, o: EngineOutcome) -> None:
        self.send({"op": "out", "id": o.record_id, "output": o.output, "error": o.error,
                   "kind": o.error_kind, "in": o.input_tokens, "outt": o.output_tokens,
                   "finish": o.finish_reason, "constrained": o.constrained})


class _Source:
    """The engine's view of the requests: the exact length check happens here, in the
    engine's own thread, so a tokenizer is never used from two threads at once."""

    def __init__(self, engine: Engine, writer: _Writer, max_input_tokens: int | None) -> None:
        self.engine = engine
        self.writer = writer
        self.max_input_tokens = max_input_tokens
        self.inbox: queue.Queue[EngineRequest | None] = queue.Queue()
        self.closed = False

    def _admit(self, req: EngineRequest) -> bool:
        if self.max_input_tokens is None:
            return True
        n = self.engine.count_tokens(req.text)
        if n <= self.max_input_tokens:
            return True
        self.writer.outcome(EngineOutcome(req.record_id, error=f"{n} input tokens, over max_input_tokens="
                                          f"{self.max_input_tokens}", error_kind="too_long", input_tokens=n))
        return False

    def _render(self, req: EngineRequest) -> EngineRequest | None:
        """A conversation's prompt, from the engine's chat template (here, in the engine's
        thread, like the tokenizer). A template that refuses the conversation (say, roles
        that do not alternate) fails this record alone, as an engine error would."""
        if req.messages is None:
            return req
        try:
            prompt = chat_prompt(self.engine, req.messages)
        except Exception as exc:
            self.writer.outcome(EngineOutcome(req.record_id, error="the chat template refused the conversation: "
                                              f"{type(exc).__name__}: {' '.join(str(exc).split())}",
                                              error_kind="engine_error"))
            return None
        # No shared instruction prefix: conversations differ from their first message on.
        return replace(req, prompt=prompt, prefix="")

    def _take(self, max_items: int, block: bool) -> list[EngineRequest]:
        out: list[EngineRequest] = []
        while len(out) < max_items and not self.closed:
            try:
                item = self.inbox.get(block=block and not out)
            except queue.Empty:
                break
            if item is None:
                self.closed = True
                break
            request = self._render(item)
            if request is not None and self._admit(request):
                out.append(request)
        return out

    def withdraw(self) -> list[str]:
        """Takes back every request the engine has not taken: the worker is stopping, and
        they go back to its shard unanswered. The engine keeps what it has taken."""
        ids: list[str] = []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return ids
            if item is None:
                self.inbox.put(None)  # the end of input stays for the engine to see
                return ids
            ids.append(item.record_id)

    def next_batch(self, max_items: int) -> list[EngineRequest]:
        while not self.closed:
            batch = self._take(max_items, block=True)
            if batch:
                return batch
        return []

    def poll(self, max_items: int) -> list[EngineRequest]:
        return self._take(max_items, block=False)


def _read_requests(stdin: IO[str], source: _Source) -> None:
    for line in stdin:
        msg = json.loads(line)
        if msg["op"] == "req":
            messages = msg.get("messages")
            source.inbox.put(EngineRequest(msg["id"], msg["prompt"], msg["prefix"], msg["text"],
                                           tuple(messages) if messages is not None else None))
        elif msg["op"] == "withdraw":
            source.writer.send({"op": "withdrawn", "ids": source.withdraw()})
        elif msg["op"] == "end":
            break
    source.inbox.put(None)


def main() -> int:
    _die_with_parent()
    # The supervisor decides when to stop; a terminal's Ctrl-C reaches the whole
    # process group and must not kill the engine under records being written.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdout = sys.stdout
    # Engines that print (llama.cpp does) must not corrupt the protocol stream.
    sys.stdout = sys.stderr
    writer = _Writer(stdout)
    init = json.loads(sys.stdin.readline())
    config = EngineConfig(
        model=ModelSpec(**init["model"]),
        decoding=DecodingSpec(**init["decoding"]),
        output_schema=init["schema"],
        work_dir=Path(init.get("work_dir") or os.getcwd()),
    )
    try:
        engine = create_engine(config)
        engine.load()
    except EngineFatal as exc:
        writer.send({"op": "fatal", "error": str(exc)})
        return 1
    except Exception as exc:
        writer.send({"op": "fatal", "error": f"engine failed to load: {type(exc).__name__}: {exc}"})
        return 1
    writer.send({"op": "ready"})
    source = _Source(engine, writer, init.get("max_input_tokens"))
    threading.Thread(target=_read_requests, args=(sys.stdin, source), daemon=True).start()
    try:
        for outcome in engine.generate(source):
            writer.outcome(outcome)
    except EngineFatal as exc:
        writer.send({"op": "fatal", "error": str(exc)})
        return 1
    except Exception as exc:
        writer.send({"op": "fatal", "error": f"engine failed: {type(exc).__name__}: {exc}"})
        return 1
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
