"""A plug-in's extra costs only that plug-in: where pyiceberg, deltalake and obstore cannot be
imported, a table's or a dataset's section still parses (reading a snapshot or listing a bucket
is using the plug-in, and needs its extra), a version stored with an Iceberg target is read,
validated and exported as before, and only publishing into the table is refused, with one line
that names the extra to install and nothing recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from batchline.check.validate import validate
from batchline.spec import load_spec
from tests.helpers import make_records, planned, run_to_seal
from tests.iceberg_support import with_table

ROOT = Path(__file__).resolve().parents[2]
# What the iceberg, delta and lake extras bring; refused in the child as an uninstalled package is.
EXTRAS_ONLY = ("pyiceberg", "deltalake", "obstore")

PRELUDE = f"""
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ImportError(f"No module named {{name!r}}")
        return None

sys.meta_path.insert(0, Refuse())
EXTRAS = {EXTRAS_ONLY!r}
"""

PARSE = PRELUDE + """
import json
from batchline.spec import load_spec
out = {}
for path in sys.argv[1:]:
    spec = load_spec(path)
    out[path] = [type(spec.input.source).__name__] + [t.describe() for t in spec.targets]
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(EXTRAS))
print(json.dumps({"parsed": out, "loaded": loaded}))
"""

CLI = PRELUDE + """
from batchline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_extras(program: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}
    return subprocess.run([sys.executable, "-c", program, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def write_spec(path: Path, input_section: dict[str, Any], output: dict[str, Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "schema.json").write_text(json.dumps({"type": "object", "properties": {}}))
    path.write_text(yaml.safe_dump({
        "name": path.stem, "input": {"id_field": "id", "acl_field": "acl", **input_section},
        "model": {"engine": "synthetic"}, "prompt": {"text": "Classify.\n", "version": "v1"},
        "output": {"schema": "schema.json", **output}}))
    return str(path)


def test_every_source_and_target_section_parses_where_their_extras_cannot_be_imported(tmp_path: Path) -> None:
    specs = [
        write_spec(tmp_path / "iceberg.yaml", {"table": {"catalog": "store", "name": "lake.tickets"}},
                   {"table": {"catalog": "store", "name": "lake.results"}}),
        write_spec(tmp_path / "delta.yaml", {"delta": {"uri": "s3://lake/tickets", "version": 42}},
                   {"dataset": "s3://lake/results"}),
    ]
    done = without_extras(PARSE, *specs)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["loaded"] == [], "parsing a spec imported an extra's package"
    assert sorted(found["parsed"]) == sorted(specs)
    # Read as where every extra is installed.
    for path in specs:
        spec = load_spec(path)
        assert found["parsed"][path] == [type(spec.input.source).__name__, *(t.describe() for t in spec.targets)]


def test_a_version_with_an_iceberg_target_is_read_and_exported_without_pyiceberg_and_only_its_publish_refused(
        job_factory: Any, store: Any, store_url: str, tmp_path: Path) -> None:
    path = with_table(job_factory(make_records(30), validate={"max_dead_letter_rate": 0.5}), tmp_path / "wh")
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return without_extras(CLI, *args, "--store", store_url)

    status = cli("status", version, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["version"] == version
    checked = cli("validate", version, "--json")
    assert checked.returncode == 0, checked.stderr
    out = tmp_path / "results.jsonl"
    exported = cli("export", version, "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert len(out.read_text().splitlines()) == 30

    refused = cli("publish", version)
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    [line] = refused.stderr.strip().splitlines()
    assert "batchline[iceberg]" in line and "Traceback" not in refused.stderr
    assert store.publications("test-job") == []
    assert store.published().get("test-job") is None
