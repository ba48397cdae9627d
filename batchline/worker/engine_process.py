"""The supervisor's handle on the engine child process."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, cast

from batchline.errors import EngineFatal
from batchline.worker.build import batchline_build

EOF_MESSAGE: dict[str, Any] = {"op": "eof"}


def describe_exit(code: int | None) -> str:
    """How a process ended, as a person reads it: a negative status is the signal that
    killed it (a segfault, the out-of-memory killer's SIGKILL)."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class EngineStopped(Exception):
    """The worker was asked to stop while its engine was loading."""


ENGINE_LOGGER = "batchline.engine"


def _relay_stderr(stream: IO[bytes]) -> None:
    """The engine child's stderr (Python tracebacks, a native library's own prints), a line
    at a time through the worker's logging: under --log-format json every line the worker
    writes is JSON, whoever wrote it. Bytes that are not UTF-8 are replaced, never fatal:
    a reader that stopped would leave the child blocked on a full pipe."""
    log = logging.getLogger(ENGINE_LOGGER)
    try:
        for raw in stream:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line:
                continue
            if logging.getLogger().handlers and log.isEnabledFor(logging.INFO):
                log.info(line)
            else:  # the worker used as a library, logging not set up for it: as the child wrote it
                sys.stderr.write(line + "\n")
    except (OSError, ValueError):
        pass


class EngineProcess:
    """Starts the child, sends it requests without ever blocking the supervisor,
    and delivers its messages through a queue (`eof` when it is gone).

    The child leads a process group of its own, and killing it kills the group: the
    processes an engine starts (vLLM's engine core and its workers) die with it."""

    def __init__(self, init: dict[str, Any], load_timeout: float) -> None:
        self.init = {**init, "batchline": batchline_build()}
        self.load_timeout = load_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        self._outbox: queue.Queue[str | None] = queue.Queue()
        self.runtime: str | None = None  # the engine's packages and versions, as the child reported them

    def start(self, stop: threading.Event | None = None) -> None:
        self.messages = queue.Queue()
        self._outbox = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchline.worker.child"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            process_group=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        stderr = cast(io.TextIOWrapper, self.proc.stderr).buffer  # bytes: a native library's output need not be UTF-8
        threading.Thread(target=_relay_stderr, args=(stderr,), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.messages), daemon=True).start()
        threading.Thread(target=self._write, args=(self.proc.stdin, self._outbox), daemon=True).start()
        self._outbox.put(json.dumps({"op": "init", **self.init}))
        deadline = time.monotonic() + self.load_timeout
        while True:
            remaining = deadline - time.monotonic()
            if stop is not None and stop.is_set():
                self.kill()
                raise EngineStopped
            if remaining <= 0:
                self.kill()
                raise EngineFatal(f"engine did not load within {self.load_timeout:.0f}s")
            try:
                msg = self.messages.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if msg["op"] == "ready":
                self.runtime = msg.get("runtime")
                return
            if msg["op"] == "fatal":
                self.kill()
                raise EngineFatal(msg["error"])
            if msg["op"] == "eof":
                code = self.kill()
                raise EngineFatal(f"engine process exited while loading ({describe_exit(code)})")

    @staticmethod
    def _read(stream: IO[str], out: queue.Queue[dict[str, Any]]) -> None:
        try:
            for line in stream:
                out.put(json.loads(line))
        except (ValueError, OSError):
            pass
        out.put(EOF_MESSAGE)

    @staticmethod
    def _write(stream: IO[str], outbox: queue.Queue[str | None]) -> None:
        try:
            while (line := outbox.get()) is not None:
                stream.write(line + "\n")
                stream.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def send(self, requests: list[dict[str, Any]]) -> None:
        for r in requests:
            self._outbox.put(json.dumps({"op": "req", **r}, separators=(",", ":")))

    def withdraw(self) -> None:
        """Asks the child to give back the records it has not started; it answers with a
        `withdrawn` message listing them (the worker is stopping: they go back unanswered)."""
        self._outbox.put(json.dumps({"op": "withdraw"}))

    def get(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.messages.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def kill(self) -> int | None:
        """Kills the child at once (its records in flight are lost, never charged)."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        self._outbox.put(None)
        # The group, not the child alone: what the engine started goes too, even once the
        # child has exited (its reaper may not have had its turn yet).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        return code

    def close(self) -> None:
        self.kill()

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def ended(self, timeout: float) -> int | None:
        """The child's exit status, waiting up to `timeout` for it: its output closes a
        moment before the kernel has its status to report. None while it still runs."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
