"""Planning reads every engine's declared options from its module, so each engine module
imports without the engine's extra: a planner (or a CI job) without llama.cpp, torch or vLLM
plans and checks a job of any engine, in a process where those libraries cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("llama_cpp", "llguidance", "torch", "transformers", "tokenizers", "vllm", "sentence_transformers",
               "httpx")

PROGRAM = f"""
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ImportError(f"{{name}} is not installed here")
        return None

sys.meta_path.insert(0, Refuse())
from batchline.registry import ENGINES
from batchline.errors import SpecError
from tests.unit.test_engine_options import job, with_options
from pathlib import Path
from batchline.spec import load_spec

out = {{}}
for name in ENGINES:
    folder = Path(sys.argv[1])
    load_spec(job(folder, name))
    try:
        load_spec(job(folder / "typo", name, with_options(name, nonesuch=1)))
    except SpecError as exc:
        out[name] = str(exc)
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({EXTRAS_ONLY!r}))
print(json.dumps({{"refused": out, "loaded": loaded}}))
"""


def test_every_engines_options_are_checked_where_no_engine_library_can_be_imported(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["loaded"] == []
    from batchline.registry import ENGINES

    assert set(found["refused"]) == set(ENGINES)
    for name, line in found["refused"].items():
        assert f"model.options.nonesuch: not an option of the {name} engine" in line
