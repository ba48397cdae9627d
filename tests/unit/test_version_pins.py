"""Job versions do not move: the same spec over the same input hashes to the same version
across releases. A refactor that re-hashed every version would orphan every stored
result (incremental runs find their base by version) and re-run every nightly job.

The specs in tests/data/pinned are frozen copies (the examples may change; these may not);
their versions were computed by the release that introduced this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline.snapshot import file_digest
from batchline.spec import load_spec

PINNED = Path(__file__).resolve().parents[1] / "data" / "pinned"

VERSIONS = {
    "llamacpp.yaml": "ticket-triage@2f06d63b16d3b846",
    "synthetic.yaml": "ticket-triage-synthetic@1c6e44f9d37f50ba",
    "routed.yaml": "routed@f6297a3e1f4c00f0",
}


@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_a_pinned_spec_keeps_its_version(name: str) -> None:
    spec = load_spec(PINNED / name)
    assert spec.version(file_digest(spec.input)) == VERSIONS[name]


def test_the_pin_notices_a_change_that_can_change_a_result(tmp_path: Path) -> None:
    # The pins can fail: one more output token allowed is a new version.
    text = (PINNED / "synthetic.yaml").read_text().replace("max_tokens: 200", "max_tokens: 201")
    for f in PINNED.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "synthetic.yaml").write_text(text)
    spec = load_spec(tmp_path / "synthetic.yaml")
    assert spec.version(file_digest(spec.input)) != VERSIONS["synthetic.yaml"]
