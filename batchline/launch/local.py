"""The `local` launcher: a detached `batchline run` on this machine, for one-machine
deployments (an Airflow worker or a Dagster run that is the machine the workers run on).

The runner is its own session (a task's process that dies does not take it along) and keeps
`workers` worker processes running until the version seals, as `batchline run` does; it is
found again by its pid file, named after the launch key in the runner folder, so a retried
task, or an intent whose launch was never recorded, re-attaches to a runner that is alive
instead of starting a second one. The store URL reaches it through its environment, never
its command line, where other users of the machine could read it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from batchline.errors import BatchlineError, SpecError
from batchline.launch.fleet import LaunchRequest

STOP_SECONDS = 60.0  # a runner told to stop gives its workers this long to give their leases back


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), which a reused pid does not share."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # A zombie (a runner that exited, not yet reaped by the process that started it) is gone.
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _alive(detail: Mapping[str, Any]) -> bool:
    pid, started = detail.get("pid"), detail.get("started")
    return isinstance(pid, int) and started is not None and _started(pid) == started \
        and detail.get("host") == socket.gethostname()


class LocalLauncher:
    name = "local"
    options: ClassVar[Mapping[str, str]] = {
        "runner_dir": "the folder of the runners' pid files and logs (default: ~/.batchline/runners)",
    }

    def _folder(self, request: LaunchRequest) -> Path:
        return Path(request.option("runner_dir") or Path.home() / ".batchline" / "runners").expanduser()

    def _pid_file(self, request: LaunchRequest) -> Path:
        digest = hashlib.sha256(f"{request.version}\0{request.key}".encode()).hexdigest()[:16]
        return self._folder(request) / f"{digest}.json"

    def check(self, request: LaunchRequest) -> None:
        if not Path(request.spec).is_file():
            raise SpecError(f"launcher local: spec {request.spec} is not a file on this machine")

    def launch(self, request: LaunchRequest) -> dict[str, Any]:
        pid_file = self._pid_file(request)
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(pid_file.read_text())
            if isinstance(found, dict) and _alive(found):
                return found  # an earlier try's runner, still running: nothing is started twice
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        log = pid_file.with_suffix(".log")
        args = [sys.executable, "-m", "batchline", "run", request.spec, "--workers", str(request.workers),
                "--plan-key", request.plan_key, "--log-dir", str(pid_file.with_suffix(".workers"))]
        if request.deadline is not None:
            args += ["--deadline", request.deadline]
        env = {**os.environ, "BATCHLINE_STORE": request.store_url}
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        started = None
        for _ in range(100):  # /proc has the process at once, its stat line as soon as it runs
            started = _started(proc.pid)
            if started is not None:
                break
            time.sleep(0.01)
        detail = {"pid": proc.pid, "started": started, "host": socket.gethostname(), "log": str(log)}
        tmp = pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(detail))
        tmp.replace(pid_file)
        return detail

    def stop(self, request: LaunchRequest, detail: Mapping[str, Any]) -> None:
        if not _alive(detail):
            return
        pid = int(detail["pid"])
        # The runner stops its workers on SIGTERM: each gives its lease back (I5).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while time.monotonic() < deadline and _alive(detail):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)
        if _alive(detail):
            raise BatchlineError(f"launcher local: runner {pid} did not stop within {STOP_SECONDS:.0f} s")

    def running(self, request: LaunchRequest, detail: Mapping[str, Any]) -> bool | None:
        # A pid means something only on the runner's host: from another, it cannot be told.
        if detail.get("host") != socket.gethostname():
            return None
        return _alive(detail)


LOCAL = LocalLauncher()
