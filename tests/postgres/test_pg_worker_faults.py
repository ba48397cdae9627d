"""The core acceptance tests (kill -9, SIGSTOP past the lease, SIGTERM, poison
records) against PostgreSQL: the same functions, collected here, where
`store_url` names a fresh PostgreSQL database (see conftest.py)."""

from __future__ import annotations

import pytest

# Imported to be collected again under this folder's `store_url`; pytest finds
# the fixture and the tests by name, so they look unused to a linter.
from tests.acceptance.test_worker_faults import (  # noqa: F401
    slow_job,
    test_a_worker_with_no_work_left_exits_0,
    test_an_engine_that_cannot_load_stops_the_worker_and_keeps_no_shard,
    test_kill_9_mid_shard_loses_nothing_and_recomputes_only_what_was_in_flight,
    test_poison_records_cost_only_themselves,
    test_sigstop_past_the_lease_then_sigcont_is_fenced_off,
    test_sigterm_finishes_in_flight_records_gives_the_lease_back_and_exits_75,
)

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]
