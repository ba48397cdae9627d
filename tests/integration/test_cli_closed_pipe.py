"""A reader that leaves early (`batchline ... | head`) ends the command quietly, as it
ends any Unix tool: no traceback, the shell's status for a closed pipe."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from batchline.cli import EXIT_READER_LEFT
from batchline.store import Store
from tests.helpers import planned, run_to_seal


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs the command with its stdout a pipe whose reader has already gone: its first
    write (or the flush of what it buffered) meets a closed pipe."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "batchline", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.fixture
def sealed_version(job_factory: Any, store: Store) -> str:
    _spec, version = planned(job_factory(n=60, options={"error_on": ["r000003"]}), store)
    run_to_seal(store, version)
    return version


@pytest.mark.parametrize("command", [
    ["validate", "{v}", "--json"],
    ["export", "{v}"],
    ["status", "{v}", "--json"],
    ["status"],
    ["dead-letters", "{v}", "--json"],
    ["dead-letters", "{v}"],
])
def test_a_command_whose_reader_left_exits_quietly_without_a_traceback(
        command: list[str], sealed_version: str, store_url: str) -> None:
    done = run_into_closed_pipe(*(a.format(v=sealed_version) for a in command), "--store", store_url)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode == EXIT_READER_LEFT, done.stderr


def test_manifests_printed_into_a_closed_pipe_exit_quietly() -> None:
    done = run_into_closed_pipe("launch", "k8s", "--job", "job@1", "--workers", "50", "--image", "img",
                                "--queue", "q", "--store-secret", "s", "--egress-cidr", "10.20.0.0/16", "--gpus-per-worker", "0")
    assert (done.stderr, done.returncode) == ("", EXIT_READER_LEFT)
