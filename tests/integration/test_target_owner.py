"""A target has one owner: a second store (a mistyped store path opened a new one; a spec copied
to another deployment) never publishes into a Parquet dataset, an Iceberg table or an index
that another store publishes into, and nothing of it moves or is registered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchline.check.validate import validate
from batchline.errors import BatchlineError
from batchline.publish.pointer import publish, rollback
from batchline.store import Store, open_store
from batchline.targets.owner import OWNER_FILE, TargetOwned
from tests.helpers import make_records, planned, run_to_seal
from tests.iceberg_support import main_rows, with_table


def sealed_in(store: Store, path: Path) -> str:
    _spec, version = planned(path, store)
    run_to_seal(store, version)
    assert validate(store, version).passed
    return version


@pytest.fixture
def other(tmp_path: Path) -> Any:
    """A second store: what a mistyped path in a connection opens."""
    second = open_store(f"sqlite:///{tmp_path / 'stroe.db'}")
    yield second
    second.close()


def refused_naming_both(store: Store, other: Store) -> str:
    return (rf"belongs to the store {store.identity()} \(.*\), not to this one, {other.identity()} \(.*\): "
            r"a store publishes only into the targets it made")


def test_a_store_keeps_one_identity_and_two_stores_have_two(store: Store, other: Store) -> None:
    assert store.identity() == store.identity() and other.identity() != store.identity()
    reopened = open_store(other.url)
    try:
        assert reopened.identity() == other.identity()
    finally:
        reopened.close()


def test_a_second_store_publishing_into_a_parquet_dataset_another_store_owns_is_refused_naming_both(
        job_factory: Any, store: Store, other: Store, tmp_path: Path) -> None:
    from batchline.targets.parquet import ParquetDataset, version_folder

    dataset = ParquetDataset(tmp_path / "warehouse")
    path = job_factory(make_records(20))
    mine = sealed_in(store, path)
    publish(store, mine, targets=[dataset])
    theirs = sealed_in(other, job_factory(make_records(25, "x")))
    with pytest.raises(TargetOwned, match=refused_naming_both(store, other)):
        publish(other, theirs, targets=[dataset])
    name = store.job(mine).name  # type: ignore[union-attr]
    assert dataset.current(name) == version_folder(mine)
    assert not dataset.folder(name, theirs).exists()  # refused before anything was written
    assert other.resolve_name(name) is None and other.publications(name) == []
    # The owner itself goes on publishing and rolling back as before.
    second = sealed_in(store, job_factory(make_records(30, "y")))
    publish(store, second, targets=[dataset])
    assert rollback(store, name, targets=[dataset]) == (second, mine)
    assert dataset.current(name) == version_folder(mine)


def test_a_second_store_with_its_own_catalog_never_registers_a_table_over_another_stores_warehouse(
        job_factory: Any, store: Store, other: Store, tmp_path: Path) -> None:
    from batchline.sources.iceberg import TableRef, load_table, open_catalog

    warehouse = tmp_path / "lake"
    mine = sealed_in(store, with_table(job_factory(make_records(20)), warehouse))
    publish(store, mine)
    theirs = sealed_in(other, with_table(job_factory(make_records(25, "x")), warehouse))
    with pytest.raises(TargetOwned, match=refused_naming_both(store, other)):
        publish(other, theirs)
    with open_catalog(TableRef("store", "lake.results"), other.url) as catalog:
        assert load_table(catalog, TableRef("store", "lake.results")) is None
    assert {version for _id, _outcome, version in main_rows(store.url, "lake.results")} == {mine}


def test_a_second_store_publishing_into_an_index_another_store_owns_is_refused_naming_both(
        store: Store, other: Store, tmp_path: Path) -> None:
    from tests.integration.test_retrieval_index import index_job

    records = [{"id": f"a{i:06d}", "text": f"ticket {i}", "acl": ["group-1"]} for i in range(12)]
    mine = sealed_in(store, index_job(tmp_path, records, engine="synthetic", tag="mine"))
    publish(store, mine)
    theirs = sealed_in(other, index_job(tmp_path, records[:6], engine="synthetic", tag="theirs"))
    with pytest.raises(TargetOwned, match=refused_naming_both(store, other)):
        publish(other, theirs)
    assert (tmp_path / "index" / f"tickets-index.{OWNER_FILE}").exists()


@pytest.mark.parametrize("text", ["", "{}", '{"store": "x"}', '{"store": "", "where": "y"}', "not json",
                                  '{"store": "x", "where": "y", "also": 1}'])
def test_an_owner_record_that_cannot_be_read_exactly_refuses_every_store(
        job_factory: Any, store: Store, tmp_path: Path, text: str) -> None:
    from batchline.targets.parquet import ParquetDataset

    dataset = ParquetDataset(tmp_path / "warehouse")
    version = sealed_in(store, job_factory(make_records(5)))
    name = store.job(version).name  # type: ignore[union-attr]
    marker = tmp_path / "warehouse" / name / OWNER_FILE
    marker.parent.mkdir(parents=True)
    marker.write_text(text)
    with pytest.raises(TargetOwned, match="not an owner record batchline wrote"):
        publish(store, version, targets=[dataset])
    assert store.resolve_name(name) is None


class WrittenBeforeOwners:
    """A plug-in target written before targets had owners: everything but `claim`."""

    key = "before-owners"

    def describe(self) -> str:
        return "an older plug-in's target"

    def stage(self, store: Any, job: Any) -> bool:
        raise AssertionError("staged a target that cannot say its owner")


def test_a_plugin_target_without_claim_is_refused_in_one_line_and_nothing_is_published(
        job_factory: Any, store: Store) -> None:
    version = sealed_in(store, job_factory(make_records(5)))
    with pytest.raises(BatchlineError, match=r"^an older plug-in's target: its target does not say which store "
                                             r"publishes into it \(`claim`.*nothing was published$"):
        publish(store, version, targets=[WrittenBeforeOwners()])  # type: ignore[list-item]
    assert store.resolve_name(store.job(version).name) is None  # type: ignore[union-attr]
