"""The engine child as a process: the protocol on descriptors of its own, a process group
that dies as one, the same batchline as its supervisor, and the engine runtime a version
was first computed with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.digests import sha256_tree
from batchline.errors import EngineFatal
from batchline.spec import DecodingSpec
from batchline.store import Store
from batchline.worker.engine_process import EngineProcess
from tests.helpers import SIMPLE_SCHEMA, planned

pytestmark = pytest.mark.acceptance


def synthetic(tmp_path: Path) -> EngineProcess:
    return EngineProcess({"model": {"engine": "synthetic", "path": None, "digest": None, "options": {}},
                          "decoding": DecodingSpec().to_dict(), "schema": SIMPLE_SCHEMA,
                          "max_input_tokens": None, "work_dir": str(tmp_path)}, load_timeout=60)


def answer(engine: EngineProcess) -> dict[str, Any]:
    engine.send([{"id": "r1", "prompt": "Classify.\nprinter", "prefix": "Classify.\n", "text": "printer"}])
    msg = engine.get(30)
    assert msg is not None and msg["op"] == "out", msg
    return msg


def test_processes_the_engine_starts_logged_into_the_protocol_pipe_on_fd_1(tmp_path: Path) -> None:
    engine = synthetic(tmp_path)
    engine.start()
    try:
        assert engine.proc is not None
        fds = Path(f"/proc/{engine.proc.pid}/fd")
        # What vLLM's engine core inherits: stderr as descriptor 1, nothing to read on 0.
        assert os.readlink(fds / "1") == os.readlink(fds / "2")
        assert os.readlink(fds / "0") == os.devnull
        assert answer(engine)["id"] == "r1"
    finally:
        engine.kill()


def _in_group(engine: EngineProcess) -> subprocess.Popen[bytes]:
    """A process in the child's group, as one the engine started would be."""
    assert engine.proc is not None
    assert os.getpgid(engine.proc.pid) == engine.proc.pid
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], process_group=engine.proc.pid)


def test_killing_the_engine_child_left_what_it_started_alive(tmp_path: Path) -> None:
    engine = synthetic(tmp_path)
    engine.start()
    started = _in_group(engine)
    engine.kill()
    assert started.wait(timeout=10) == -signal.SIGKILL
    # A child that dies on its own (a crash) takes its group with it too: its reaper sees to it.
    engine.start()
    started = _in_group(engine)
    assert engine.proc is not None
    os.kill(engine.proc.pid, signal.SIGKILL)
    assert started.wait(timeout=10) == -signal.SIGKILL
    engine.kill()


def test_a_child_of_another_batchline_build_is_refused_by_its_supervisor(tmp_path: Path) -> None:
    engine = synthetic(tmp_path)
    engine.init["batchline"] = "0.1.0+000000000000"
    with pytest.raises(EngineFatal, match=r"the engine child runs batchline \S+ from \S+, its supervisor "
                                          r"batchline 0\.1\.0\+000000000000"):
        engine.start()
    assert engine.proc is None


def test_a_worker_whose_engine_runtime_differs_from_the_versions_refuses_it(
        job_factory: Callable[..., Path], store: Store, store_url: str, tmp_path: Path) -> None:
    from tests.integration.engines.support import save_tiny_llama

    model = tmp_path / "tiny"
    save_tiny_llama(model)
    spec_path = job_factory(n=4, model={"engine": "transformers", "path": str(model),
                                        "digest": "sha256:" + sha256_tree(model), "options": {"device": "cpu"}})
    _spec, version = planned(spec_path, store)
    store.pin_runtime(version, "transformers 4.0.0, torch 1.0.0", "an-earlier-worker")
    worker = subprocess.run([sys.executable, "-m", "batchline", "worker", "--store", store_url, "--job", version],
                            capture_output=True, text=True, timeout=300)
    assert worker.returncode == 5
    line = worker.stderr.strip().splitlines()[-1]
    assert line.startswith("batchline: error: version ") and "\n" not in line
    assert ("is computed with the engine runtime transformers 4.0.0, torch 1.0.0 (first loaded by worker "
            "an-earlier-worker), and this worker's engine is transformers ") in line
    assert all(row.state == "ready" for row in store.shard_rows(version))
    assert not list(store.iter_results(version))
