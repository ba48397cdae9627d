"""What the orchestrators' tests leave behind is stopped with them: a local launcher's detached
runner outlives the task that started it by design, and must not outlive the test (whose
store it would go on trying to reach)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def runners_stopped(tmp_path: Path) -> Iterator[None]:
    yield
    for pid_file in tmp_path.rglob("runners/*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = int(json.loads(pid_file.read_text())["pid"])
            os.killpg(pid, signal.SIGTERM)
            for _ in range(50):
                time.sleep(0.1)
                os.killpg(pid, 0)  # raises once the group is gone
            os.killpg(pid, signal.SIGKILL)
