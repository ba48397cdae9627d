"""The worker image (container/Containerfile): its installation, container/install.sh, run
into a fresh virtualenv from exactly what the Containerfile copies into the image, gives a
working `batchline` with the llama.cpp engine, PostgreSQL, the lake and Iceberg, and no
torch; and the image runs as the user the Kubernetes manifests demand.

No container engine runs on the test machines, so the image itself is not built here; the
install is the part that can break. It reuses pip's cache, where `make setup` left the
llama.cpp wheel it built: the install then takes about a minute on the two-core test machine
(the other packages come from PyPI); without that wheel, compiling llama.cpp adds about 8.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import batchline
from batchline.launch.k8s import NON_ROOT_UID

ROOT = Path(__file__).resolve().parents[3]
CONTAINERFILE = ROOT / "container" / "Containerfile"
# Room for compiling llama.cpp when pip's cache does not hold its wheel.
INSTALL_TIMEOUT = 20 * 60

pytestmark = pytest.mark.container


def instructions(path: Path) -> list[list[str]]:
    """The Containerfile's instructions, continuation lines joined, each split into words."""
    out: list[list[str]] = []
    joined = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            out.append(joined.split())
            joined = ""
    return out


def copy_build_context(dest: Path) -> Path:
    """What the build stage's COPY instructions put under /src, copied to `dest`: the image
    builds from these files alone, so the test does too."""
    for words in instructions(CONTAINERFILE):
        if words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        *sources, target = words[1:]
        assert target.startswith("/src"), f"COPY into {target}: the install reads /src only"
        where = dest / target.removeprefix("/src").lstrip("/")
        for source in sources:
            into = where / Path(source).name if target.endswith("/") else where
            into.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(ROOT / source, into)
    return dest


def test_the_image_runs_as_the_non_root_user_of_the_k8s_manifests_with_batchline_as_entrypoint() -> None:
    final = instructions(CONTAINERFILE)
    last_stage = max(i for i, words in enumerate(final) if words[0] == "FROM")
    runtime = final[last_stage:]
    assert ["USER", f"{NON_ROOT_UID}:{NON_ROOT_UID}"] in runtime
    assert ["ENTRYPOINT", '["batchline"]'] in runtime
    assert any(words[0] == "RUN" and f"--uid {NON_ROOT_UID}" in " ".join(words) for words in runtime)


def test_the_install_script_gives_a_worker_with_llamacpp_postgres_lake_and_iceberg_and_no_torch(
        tmp_path: Path) -> None:
    source = copy_build_context(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # pip's cache stays on (no PIP_NO_CACHE_DIR); nothing of this checkout's environment leaks in.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONPATH", "CMAKE_ARGS", "BATCHLINE_IMAGE"))}
    install = subprocess.run(["sh", str(source / "container" / "install.sh"), str(python), str(source)], env=env,
                             capture_output=True, text=True, timeout=INSTALL_TIMEOUT, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-4000:]

    run = subprocess.run([str(venv / "bin" / "batchline"), "--help"], env=env, capture_output=True, text=True,
                         cwd=tmp_path)
    assert run.returncode == 0 and "batchline" in run.stdout, run.stderr
    probe = ("import importlib.metadata, importlib.util, json, batchline, llama_cpp, obstore, pyiceberg, psycopg, "
             "prometheus_client; print(json.dumps({'version': importlib.metadata.version('batchline'), "
             "'file': batchline.__file__, 'torch': importlib.util.find_spec('torch') is not None}))")
    found = subprocess.run([str(python), "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    facts = json.loads(found.stdout)
    assert facts["version"] == batchline.__version__
    shown = subprocess.run([str(venv / "bin" / "batchline"), "--version"], env=env, capture_output=True, text=True,
                           cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.strip() == f"batchline {batchline.__version__}", shown.stderr
    # The package is in the environment itself, not a link back to a source folder.
    assert Path(facts["file"]).is_relative_to(venv)
    assert facts["torch"] is False
