"""Helpers both provider clients' tests use."""

from __future__ import annotations

from batchline.providers.base import BatchAnswer, BatchProvider, BatchRequest, SubmittedBatch


def requests_for(*ids: str) -> list[BatchRequest]:
    return [BatchRequest(i, f"prompt of {i}") for i in ids]


def run_to_end(provider: BatchProvider, batch: SubmittedBatch, limit: int = 20) -> list[str]:
    statuses = []
    for _ in range(limit):
        progress = provider.progress(batch)
        statuses.append(progress.status)
        if progress.ended:
            return statuses
    raise AssertionError(f"the batch did not end: {statuses}")


def by_id(answers: list[BatchAnswer]) -> dict[str, BatchAnswer]:
    out = {a.custom_id: a for a in answers}
    assert len(out) == len(answers), "a custom id was answered twice"
    return out
