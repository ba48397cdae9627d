"""The example of a new target in docs/extending.md, run as the page writes it: it follows a
real publish and rollback, and refuses to move from a state the store did not record, on
both stores; so the docs' example cannot rot into one that does not work."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from batchline.check.validate import validate
from batchline.errors import BatchlineError
from batchline.publish.pointer import publish, rollback
from batchline.spec.reader import ParseContext, SpecReader
from batchline.store import Store
from tests.helpers import planned, run_to_seal

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
NAME = "docs-example"


@pytest.fixture
def example(tmp_path: Path) -> Iterator[ModuleType]:
    """The page's example module: the Python block after the line that names this test."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(r"```python\n(.*?)```", text[text.index(Path(__file__).name):], re.DOTALL)
    assert found is not None
    path = tmp_path / "docs_example_target.py"
    path.write_text(found.group(1))
    spec = importlib.util.spec_from_file_location("docs_example_target", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def sealed(job_factory: Any, store: Store, n: int) -> str:
    _spec, version = planned(job_factory(n=n, name=NAME), store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


def test_the_docs_example_target_follows_publish_and_rollback_and_refuses_a_moved_latest(
        example: ModuleType, job_factory: Any, store: Store, tmp_path: Path) -> None:
    output = example.JSONL_FOLDER.parse("jsonl_folder", {"jsonl_folder": "exports"}, SpecReader("job.yaml"),
                                        ParseContext(tmp_path, {}))
    assert output.to_dict() == {"jsonl_folder": str(tmp_path / "exports")}
    target = output.target(None, {})
    first, second = sealed(job_factory, store, 20), sealed(job_factory, store, 30)

    publish(store, first, targets=[target])
    assert target.latest(NAME) == first
    lines = target.file(NAME, first).read_text().splitlines()
    assert len(lines) == 20 and all(json.loads(line)["output"] for line in lines)
    publish(store, second, targets=[target])
    assert target.latest(NAME) == second
    assert store.publications(NAME)[-1].targets == {target.key: {"latest": second}}

    rollback(store, NAME, targets=[target])
    assert target.latest(NAME) == first

    # Something else moves LATEST: the next publish is refused and moves neither it nor the store.
    (tmp_path / "exports" / NAME / "LATEST").write_text("elsewhere\n")
    with pytest.raises(BatchlineError, match=r"names 'elsewhere', not .* as the store recorded"):
        publish(store, second, targets=[target])
    assert target.latest(NAME) == "elsewhere"
    assert store.resolve_name(NAME) == first


def test_the_docs_example_target_is_put_back_only_while_it_shows_what_it_was_shown(
        example: ModuleType, tmp_path: Path) -> None:
    target = example.JsonlFolder(tmp_path / "exports")
    first = f"{NAME}@0123456789abcdef"
    target.show(NAME, first, None)
    target.restore(NAME, None, {"latest": first})
    assert target.latest(NAME) is None
    # A later publisher's change is not this one's to undo.
    target.show(NAME, first, None)
    (tmp_path / "exports" / NAME / "LATEST").write_text("later\n")
    target.restore(NAME, None, {"latest": first})
    assert target.latest(NAME) == "later"
