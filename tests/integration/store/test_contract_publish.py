"""The store contract for publication: publish and rollback are a compare-and-set on the
name's latest publication, so a publisher that read the name before another publisher
moved it records nothing. Over every store (publication is the owner's: under the worker
role it runs as the store's owner)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batchline.errors import PublicationMoved, StoreError
from batchline.store import Store
from tests.integration.store.test_contract import latest_publication, plan_version
from tests.integration.store.test_contract_housekeeping import WHO, seal


def sealed(store: Store, *versions: str) -> None:
    for version in versions:
        seal(store, version, plan_version(store, version))


def history(store: Store) -> list[tuple[str, str, str | None]]:
    return [(p.action, p.version, p.previous) for p in store.publications("job")]


def test_a_publish_is_recorded_only_while_the_publication_its_publisher_read_is_the_latest(store: Store) -> None:
    sealed(store, "job@1", "job@2", "job@3")
    assert store.publish("job", "job@1", WHO, None, None, expected=None) is None
    first = latest_publication(store, "job")
    assert first is not None
    assert store.publish("job", "job@2", WHO, None, None, expected=first) == "job@1"
    # A publisher that read the name before job@2 was published, or read it unpublished.
    for stale in (first, None):
        with pytest.raises(PublicationMoved, match=r"^cannot publish job@3 as 'job': another publish or "
                                                   r"rollback of 'job' came in between \(it now shows job@2, "
                                                   rf"published by {WHO}\); nothing was recorded: see "
                                                   r"`batchline history job` and try again$"):
            store.publish("job", "job@3", WHO, None, None, expected=stale)
    # One that read a publication the name never had.
    with pytest.raises(PublicationMoved):
        store.publish("job", "job@3", WHO, None, None, expected=10**9)
    assert store.resolve_name("job") == "job@2"
    assert history(store) == [("publish", "job@1", None), ("publish", "job@2", "job@1")]
    assert [e.detail["previous"] for e in store.events(None, ["publish"])] == [None, "job@1"]
    # Its exit status is its own, and it is a refusal of the store.
    assert PublicationMoved.exit_code == 9 and issubclass(PublicationMoved, StoreError)
    assert store.publish("job", "job@3", WHO, None, None, expected=latest_publication(store, "job")) == "job@2"


def test_a_name_never_published_refuses_a_publisher_that_read_a_publication(store: Store) -> None:
    sealed(store, "job@1")
    with pytest.raises(PublicationMoved, match=r"\(its publications are gone\)"):
        store.publish("job", "job@1", WHO, None, None, expected=1)
    assert store.resolve_name("job") is None and store.publications("job") == []


def test_a_rollback_is_recorded_only_while_the_publication_its_publisher_read_is_the_latest(store: Store) -> None:
    sealed(store, "job@1", "job@2", "job@3")
    store.publish("job", "job@1", WHO, None, None, expected=None)
    store.publish("job", "job@2", WHO, None, None, expected=latest_publication(store, "job"))
    read = latest_publication(store, "job")
    # Another publisher publishes job@3 after the rollback's publisher read the name.
    store.publish("job", "job@3", WHO, None, None, expected=read)
    with pytest.raises(PublicationMoved, match=r"^cannot roll 'job' back from job@3: another publish or "
                                               r"rollback of 'job' came in between \(it now shows job@3"):
        store.rollback("job", WHO, None, expected=read)
    assert store.resolve_name("job") == "job@3"
    assert store.rollback("job", WHO, "worse", expected=latest_publication(store, "job")) == ("job@3", "job@2")
    # And a publish whose publisher read the name before that rollback is refused in its words.
    with pytest.raises(PublicationMoved, match=r"\(it now shows job@2, rolled back to by "):
        store.publish("job", "job@1", WHO, None, None, expected=read)
    assert history(store) == [("publish", "job@1", None), ("publish", "job@2", "job@1"),
                              ("publish", "job@3", "job@2"), ("rollback", "job@2", "job@3")]


def test_two_publishers_of_one_name_that_read_it_at_once_record_one_publication(
        store: Store, open_again: Callable[[], Store]) -> None:
    other = open_again()
    try:
        sealed(store, "job@1", "job@2", "job@3")
        store.publish("job", "job@1", WHO, None, None, expected=None)
        read_here, read_there = latest_publication(store, "job"), latest_publication(other, "job")
        assert read_here == read_there
        assert other.publish("job", "job@3", "other@host", None, None, expected=read_there) == "job@1"
        with pytest.raises(PublicationMoved, match=r"it now shows job@3, published by other@host"):
            store.publish("job", "job@2", WHO, None, None, expected=read_here)
        assert store.resolve_name("job") == other.resolve_name("job") == "job@3"
        assert history(store) == [("publish", "job@1", None), ("publish", "job@3", "job@1")]
    finally:
        other.close()


def test_publishing_the_published_version_again_records_nothing_and_rollback_never_returns_to_it(
        store: Store) -> None:
    sealed(store, "job@1", "job@2")
    store.publish("job", "job@1", WHO, None, None, expected=None)
    read = latest_publication(store, "job")
    # The store answers with the version itself: nothing moved.
    assert store.publish("job", "job@1", WHO, "again", None, expected=read) == "job@1"
    assert latest_publication(store, "job") == read and history(store) == [("publish", "job@1", None)]
    assert len(store.events(None, ["publish"])) == 1
    with pytest.raises(StoreError, match=r"^'job' has no earlier version to roll back to \(current: job@1\)$"):
        store.rollback("job", WHO, None, expected=read)
    # Still a compare-and-set: a publisher that read the name before it moved is refused.
    store.publish("job", "job@2", WHO, None, None, expected=read)
    with pytest.raises(PublicationMoved, match=r"it now shows job@2"):
        store.publish("job", "job@1", WHO, None, None, expected=read)
    assert store.publish("job", "job@2", WHO, None, None, expected=latest_publication(store, "job")) == "job@2"
    assert store.rollback("job", WHO, None, expected=latest_publication(store, "job")) == ("job@2", "job@1")
    assert history(store) == [("publish", "job@1", None), ("publish", "job@2", "job@1"),
                              ("rollback", "job@1", "job@2")]
