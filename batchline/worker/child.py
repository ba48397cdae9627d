"""The engine child: loads the engine and streams outcomes for the requests it is sent.

It speaks JSON lines: an `init` message, then `req` messages on what was its
stdin; a `ready` (or `fatal`) message, then one `out` message per request on
what was its stdout. Both move to descriptors of their own at once, before any
engine is loaded: processes an engine starts (vLLM's engine core and its
workers) inherit descriptors 0 to 2 and log to 1, which is then the stderr
pipe, so nothing they write can reach the protocol.

The child leads a process group of its own (the supervisor starts it so) and
forks a reaper into it first: when the child ends, however it ends (its
supervisor killed and PR_SET_PDEATHSIG, a crash, a normal exit), the reaper
kills the whole group, so no process the engine started outlives it holding
memory or a GPU.
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

from batchline.engines import create_engine, engine_runtime
from batchline.engines.base import Engine, EngineConfig, EngineOutcome, EngineRequest, chat_prompt
from batchline.errors import EngineCrashed, EngineFatal
from batchline.spec import DecodingSpec, ModelSpec
from batchline.worker.build import batchline_build

_PR_SET_PDEATHSIG = 1


def _on_parent_death(sig: signal.Signals) -> bool:
    """Asks the kernel for `sig` when this process's parent dies; False where it cannot."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, sig) == 0)
    except (OSError, AttributeError):
        return False  # not Linux: the child still exits when its input closes


def _start_reaper() -> None:
    """Forks the process that kills this process group once this process is gone.
    Forked before any thread exists, so the fork is safe, and idle, so the signal is
    acted on at once."""
    if os.getpgrp() != os.getpid():
        return  # started by hand, not by a supervisor: the group is someone else's
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    if os.fork() != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        return
    try:
        # The protocol's pipes must close when the child goes, not when the reaper does.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if _on_parent_death(signal.SIGHUP) and os.getppid() == parent:
            signal.sigwait({signal.SIGHUP})
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # this process too
        os._exit(0)


def _protocol_streams() -> tuple[IO[str], IO[str]]:
    """The protocol's own descriptors (non-inheritable copies of 0 and 1); descriptor 1
    becomes stderr and 0 /dev/null, which is all that processes started from here inherit."""
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return requests, replies


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
    _on_parent_death(signal.SIGKILL)
    _start_reaper()
    # The supervisor decides when to stop; a terminal's Ctrl-C reaches the whole
    # process group and must not kill the engine under records being written.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requests, replies = _protocol_streams()
    sys.stdin = requests
    # Engines that print (llama.cpp does) must not corrupt the protocol stream.
    sys.stdout = sys.stderr
    writer = _Writer(replies)
    init = json.loads(requests.readline())
    build = batchline_build()
    if init.get("batchline") not in (None, build):
        writer.send({"op": "fatal", "error": f"the engine child runs batchline {build} from "
                     f"{Path(__file__).parents[1]}, its supervisor batchline {init['batchline']}: "
                     "run the worker where one batchline serves both"})
        return 1
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
    writer.send({"op": "ready", "runtime": engine_runtime(config.model.engine)})
    source = _Source(engine, writer, init.get("max_input_tokens"))
    threading.Thread(target=_read_requests, args=(requests, source), daemon=True).start()
    try:
        for outcome in engine.generate(source):
            writer.outcome(outcome)
    except EngineCrashed as exc:
        # As if this process had died: the supervisor restarts it and bisects what was in flight.
        writer.send({"op": "crash", "error": str(exc)})
        return 70
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
