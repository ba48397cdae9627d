"""Hosted routes against PostgreSQL: the same tests as tests/acceptance/test_hosted_routes.py,
collected here, where `store_url` names a fresh PostgreSQL database (see conftest.py)."""

from __future__ import annotations

import pytest

# Imported to be collected again under this folder's `store_url`; pytest finds
# the fixture and the tests by name, so they look unused to a linter.
from tests.acceptance.test_hosted_routes import (  # noqa: F401
    provider,
    test_a_batch_the_provider_refuses_whole_ends_in_dead_letters_not_a_loop,
    test_a_duplicated_answer_keeps_the_first_and_writes_one_result,
    test_a_worker_dead_before_recording_its_batch_id_is_adopted_not_resubmitted,
    test_a_worker_killed_between_submit_and_download_is_not_submitted_again,
    test_expired_requests_are_sent_again_and_not_charged,
    test_only_cleared_records_reach_the_provider_and_every_result_names_its_model,
)

pytestmark = [pytest.mark.postgres, pytest.mark.acceptance]
