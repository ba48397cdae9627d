"""Rates in the spec are shares: a dead-letter rate of 2 would let every record fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchline.errors import SpecError
from batchline.spec import load_spec
from tests.unit.test_spec import with_change, write


@pytest.mark.parametrize("rate", [2, 1.5, -0.1])
def test_a_dead_letter_rate_outside_0_to_1_is_refused_naming_the_field(tmp_path: Path, rate: float) -> None:
    with pytest.raises(SpecError) as refused:
        load_spec(write(tmp_path, with_change("validate", {"max_dead_letter_rate": rate})))
    assert str(refused.value).endswith(
        f"validate.max_dead_letter_rate: must be between 0 and 1, not {json.dumps(rate)}")


@pytest.mark.parametrize("rate", [0, 0.01, 1])
def test_a_dead_letter_rate_from_0_to_1_is_taken(tmp_path: Path, rate: float) -> None:
    spec = load_spec(write(tmp_path, with_change("validate", {"max_dead_letter_rate": rate})))
    assert spec.validate.max_dead_letter_rate == rate
