"""A record that kills the engine is dead-lettered with how the engine died, in words."""

from __future__ import annotations

from typing import Any

from batchline.store import Store
from batchline.worker.engine_process import describe_exit
from tests.helpers import planned, run_to_seal


def test_a_crash_dead_letter_names_the_signal_that_killed_the_engine(job_factory: Any, store: Store) -> None:
    # The synthetic engine kills itself with SIGKILL on this record, as the OOM killer would.
    _spec, version = planned(job_factory(n=8, options={"crash_on": ["r000002"]}), store)
    run_to_seal(store, version)
    [letter] = list(store.iter_dead_letters(version))
    assert (letter.record_id, letter.kind) == ("r000002", "crash")
    assert "engine process died (killed by SIGKILL)" in letter.error, letter.error
    assert "None" not in letter.error


def test_exit_statuses_read_as_words() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
    assert describe_exit(3) == "exit status 3"
    assert describe_exit(None) == "exit status unknown"
