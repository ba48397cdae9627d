"""What a waiting task's log says of each poll of its version (`fleet.news`): the records
answered as they move, the deadline's `at risk` line when it comes or changes, nothing else."""

from __future__ import annotations

from typing import Any

from batchline.launch.fleet import Watch, news


def polled(results: int, dead: int = 0, at_risk: str | None = None, state: str = "running") -> dict[str, Any]:
    return Watch("v1", state, f"v1: {results + dead:,} of 1,000 records answered", 1000, results, dead,
                 at_risk).to_json()


def test_the_first_poll_says_where_the_version_is() -> None:
    assert news(None, polled(0)) == [(False, "v1: 0 of 1,000 records answered")]


def test_a_poll_that_moved_nothing_says_nothing() -> None:
    assert news(polled(10), polled(10)) == []


def test_records_answered_are_said_as_they_move_with_dead_letters_when_there_are_any() -> None:
    assert news(polled(10), polled(250, 3)) == [(False, "v1: 253 of 1,000 records answered (3 dead letters)")]


def test_at_risk_is_a_warning_said_when_it_comes_or_changes_and_not_again() -> None:
    risky = polled(10, at_risk="needs 4 workers, has 2")
    assert news(polled(10), risky) == [(True, "v1: deadline at risk: needs 4 workers, has 2")]
    assert news(risky, risky) == []
    worse = polled(10, at_risk="needs 6 workers, has 2")
    assert news(risky, worse) == [(True, "v1: deadline at risk: needs 6 workers, has 2")]


def test_an_ended_version_says_no_progress_line() -> None:
    assert news(polled(990), polled(1000, state="sealed")) == []
