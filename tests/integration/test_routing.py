"""Routing by record class: nothing leaves unless its class is cleared for a provider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from batchline.errors import SpecError
from batchline.plan.planner import plan
from batchline.snapshot import Slice, read_slice, scan
from batchline.spec import LOCAL_ROUTE, load_spec
from batchline.store import Store


def routing(**provider: Any) -> dict[str, Any]:
    return {"class_field": "data_class",
            "providers": {"oai": {"api": "openai", "model": "gpt-4o-mini", "classes": ["public", "internal"],
                                  "retention": "30 days", **provider}}}


def classed(classes: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(classes):
        record: dict[str, Any] = {"id": f"r{i:03d}", "text": f"text {i}", "acl": ["g"]}
        if c is not _MISSING:
            record["data_class"] = c
        out.append(record)
    return out


_MISSING = object()


def routes_of(store: Store, version: str, spec: Any) -> dict[str, str]:
    """record id -> route, read the way workers read shards: through claims."""
    out: dict[str, str] = {}
    while (lease := store.claim("reader", version)) is not None:
        for r in read_slice(Slice.from_json(lease.slice), spec.input, spec.routing):
            assert r.id not in out, f"{r.id} is in two shards"
            out[r.id] = lease.route
    return out


def test_only_cleared_classes_leave_and_everything_else_stays_local(job_factory: Any, store: Store) -> None:
    classes = ["public", "internal", "restricted", _MISSING, None, "PUBLIC", 7, ["public"], "", " public"]
    spec = load_spec(job_factory(classed(classes), routing=routing()))
    version = plan(spec, store).version
    got = routes_of(store, version, spec)
    assert got == {"r000": "oai", "r001": "oai", **{f"r{i:03d}": LOCAL_ROUTE for i in range(2, len(classes))}}


def test_without_routing_nothing_leaves_whatever_the_records_say(job_factory: Any, store: Store) -> None:
    spec = load_spec(job_factory(classed(["public"] * 5)))
    version = plan(spec, store).version
    assert set(routes_of(store, version, spec).values()) == {LOCAL_ROUTE}


def test_each_route_gets_shards_of_its_own_at_its_own_size(job_factory: Any, store: Store) -> None:
    classes = ["public" if i % 4 == 0 else "secret" for i in range(200)]
    spec = load_spec(job_factory(classed(classes), routing=routing(shard_size=20), shards={"size": 50}))
    result = plan(spec, store)
    assert result.routes == {"oai": 50, LOCAL_ROUTE: 150}
    rows = store.shard_rows(result.version)
    assert sorted(r.record_count for r in rows if r.route == "oai") == [10, 20, 20]
    assert sorted(r.record_count for r in rows if r.route == LOCAL_ROUTE) == [50, 50, 50]
    got = routes_of(store, result.version, spec)
    assert len(got) == 200 and all((route == "oai") == (int(rid[1:]) % 4 == 0) for rid, route in got.items())


def test_routing_rules_are_part_of_the_version(job_factory: Any, store: Store, tmp_path: Path) -> None:
    records = classed(["public", "secret"])
    versions = {
        load_spec(job_factory(records, routing=routing())).version("d"),
        load_spec(job_factory(records, routing=routing(classes=["public"]))).version("d"),
        load_spec(job_factory(records, routing=routing(model="gpt-4.1-mini"))).version("d"),
        load_spec(job_factory(records)).version("d"),
    }
    assert len(versions) == 4
    # Where the provider is reached and what it costs do not change an answer.
    same = {load_spec(job_factory(records, routing=routing(base_url="http://a", poll_seconds=5))).version("d"),
            load_spec(job_factory(records, routing=routing(prices={"input_per_mtok": 1.0}))).version("d"),
            load_spec(job_factory(records, routing=routing())).version("d")}
    assert len(same) == 1


def test_a_record_whose_class_changes_is_not_carried_from_a_base(job_factory: Any) -> None:
    first = load_spec(job_factory(classed(["public", "secret"]), routing=routing()))
    second = load_spec(job_factory(classed(["secret", "secret"]), routing=routing()))
    # r000 moved from a cleared class to a local one: its content hash (what an incremental
    # run carries results by) changes with it; r001 kept its class, and its hash.
    h1 = {s.record.id: s.record.content_hash for s in scan(first.input.locations[0], first.input)}
    h2 = {s.record.id: s.record.content_hash for s in scan(second.input.locations[0], second.input)}
    assert h1["r000"] != h2["r000"] and h1["r001"] == h2["r001"]


@pytest.mark.parametrize(("change", "message"), [
    ({"api": "bedrock"}, "routing.providers.oai.api: 'bedrock' is not one of openai, anthropic"),
    ({"classes": []}, "routing.providers.oai.classes: must be a non-empty list"),
    ({"retention": None}, "routing.providers.oai.retention: is required"),
    ({"prices": {"input_per_mtok": -1}}, "routing.providers.oai.prices.input_per_mtok: must be at least 0"),
])
def test_provider_errors_name_the_field(job_factory: Any, change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_spec(job_factory(classed(["public"]), routing=routing(**change)))


def test_a_class_cleared_for_two_providers_is_refused(job_factory: Any, tmp_path: Path) -> None:
    rules = routing()
    rules["providers"]["claude"] = {"api": "anthropic", "model": "claude-haiku-4-5", "classes": ["internal"],
                                    "retention": "30 days"}
    with pytest.raises(SpecError, match=r"class 'internal' is already cleared for '(oai|claude)'; a class goes to one provider"):
        load_spec(job_factory(classed(["public"]), routing=rules))


def test_local_is_not_a_provider_route(job_factory: Any) -> None:
    rules = {"class_field": "data_class", "providers": {"local": routing()["providers"]["oai"]}}
    with pytest.raises(SpecError, match=r"must be lower-case .* and not 'local'"):
        load_spec(job_factory(classed(["public"]), routing=rules))


def test_the_plan_says_where_records_go_and_what_each_provider_keeps(job_factory: Any, store: Store) -> None:
    spec = load_spec(job_factory(classed(["public", "secret", "secret"]), routing=routing()))
    lines: list[str] = []
    plan(spec, store, log=lines.append)
    text = "\n".join(lines)
    assert "local: 2 records on synthetic" in text
    assert "oai: 1 records of classes public, internal to openai (gpt-4o-mini); data retention there: 30 days" in text


def test_the_stored_spec_round_trips_its_routing(job_factory: Any) -> None:
    from batchline.spec import parse_spec

    spec = load_spec(job_factory(classed(["public"]), routing=routing(prices={"input_per_mtok": 0.075},
                                                                      options={"service_tier": "flex"})))
    again = parse_spec(yaml.safe_load(yaml.safe_dump(spec.to_dict(), sort_keys=False)), base_dir=Path("/"))
    assert again.routing == spec.routing and again.version("d") == spec.version("d")
