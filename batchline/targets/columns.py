"""The typed columns of a version's results, from the output's JSON Schema: one mapping, read by
the Iceberg table a job publishes into (`batchline.targets.iceberg_schema` gives its Iceberg
types) and by the Parquet export (and so every Parquet dataset), so the two type alike.

Each row has the output's fields as typed columns inside one struct column, `output` (so no
output field can collide with `id`, `acl` or `model`), the raw output as JSON text, and the
record's ACL as a list of strings (`ACL`). (An Iceberg table made while ACLs were JSON text
keeps that column: see `acl_values`.)

Types: a string enum or a string is a string, an object with properties a
struct, an array a list of its items' type, a number a double, an integer a
long, a boolean a boolean; anything without one clear type (no `type`, several
types, `oneOf`, `anyOf`, `allOf`, `$ref`, an object without properties) is a
string holding its JSON. `"type": ["X", "null"]` is X (every column may be null).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchline.errors import BatchlineError

OUTPUT_COLUMN = "output"

_SCALARS = {"string": "string", "integer": "long", "number": "double", "boolean": "boolean"}
_UNCLEAR = ("oneOf", "anyOf", "allOf", "$ref", "not", "if")


@dataclass(frozen=True)
class Node:
    """A JSON Schema node's column type: a scalar (`string`, `long`, `double`, `boolean`),
    `json` (a string holding the value's JSON), a `struct` or a `list`."""

    kind: str
    fields: tuple[tuple[str, Node], ...] = ()  # struct
    element: Node | None = None  # list

    def describe(self) -> str:
        if self.kind == "struct":
            return "struct"
        if self.kind == "list":
            assert self.element is not None
            return f"list<{self.element.describe()}>"
        return "string (JSON)" if self.kind == "json" else self.kind


JSON = Node("json")


def node_of(schema: Any) -> Node:
    if not isinstance(schema, dict) or any(k in schema for k in _UNCLEAR):
        return JSON
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind is None:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else (
            [schema["const"]] if "const" in schema else None)
        return Node("string") if values and all(isinstance(v, str) for v in values) else JSON
    if kind in _SCALARS:
        return Node(_SCALARS[kind])
    if kind == "object":
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return JSON
        return Node("struct", tuple((str(name), node_of(sub)) for name, sub in props.items()))
    if kind == "array":
        items = schema.get("items")
        return Node("list", element=node_of(items) if isinstance(items, dict) else JSON)
    return JSON


def output_node(schema: Mapping[str, Any]) -> Node | None:
    """The `output` struct column, or None when the output is not an object with properties."""
    node = node_of(dict(schema))
    return node if node.kind == "struct" else None


# A record's ACL: its groups, a list of strings, on results and dead letters alike.
ACL = Node("list", element=Node("string"))


def acl_values(rows: Sequence[Any], as_text: bool = False) -> list[Any]:
    """The `acl` column's values: each record's groups, or with `as_text` (an Iceberg table
    made before ACLs were lists, which keeps its column's type) their JSON text."""
    if not as_text:
        return [None if r.acl is None else r.acl.to_list() for r in rows]
    return [acl_value(r.acl, True) for r in rows]


def acl_value(acl: Any, as_text: bool) -> Any:
    """One record's `acl` value (see `acl_values`): its groups, or their JSON text, or None."""
    if acl is None:
        return None
    return json.dumps(acl.to_list(), sort_keys=True) if as_text else acl.to_list()


CARRY_COLUMN = "carry"
PROVENANCE_COLUMN = "provenance"
# output.provenance: which attempt a row is (StoredResult.provenance).
PROVENANCE = Node("struct", (("attempt", Node("long")), ("worker", Node("string")), ("epoch", Node("long")),
                             ("origin_version", Node("string"))))


def provenance_values(rows: Sequence[Any], version: str) -> list[dict[str, Any]]:
    return [r.provenance(version) for r in rows]


ORIGIN_COLUMN = "origin_version"


def origin_values(rows: Sequence[Any], version: str) -> list[str]:
    """The `origin_version` column: the version that computed each row (`version` itself, or
    for a carried result the one it was carried from), beside `version`, the one published. A
    downstream merge keys on it (with `created_at`, the computing attempt's time) to take only
    what a version computed anew."""
    return [r.origin or version for r in rows]


def carry_node(names: Sequence[str]) -> Node | None:
    """The `carry` struct column (output.carry's input fields), or None for a job that carries
    none. Each field is a string: an input field has no type its job declares, and a column's
    type may not change from one version to the next, so a value that is not a string is
    written as its JSON text."""
    return Node("struct", tuple((name, Node("string")) for name in names)) if names else None


def carry_values(rows: Sequence[Any]) -> list[dict[str, Any] | None]:
    """The `carry` column's values: each row's carried fields, strings as they are and other
    values as their JSON text (null stays null)."""
    dumps = json.dumps

    def text(v: Any) -> Any:
        return v if v is None or isinstance(v, str) else dumps(v, ensure_ascii=False, separators=(",", ":"))

    return [None if r.carry is None else {k: text(v) for k, v in r.carry.items()} for r in rows]


# --- Arrow types -----------------------------------------------------------------


def arrow_type(node: Node) -> Any:
    """The Arrow type of a node's column (the Parquet export's; an Iceberg table's Arrow schema
    comes from the table, whose columns are `iceberg_schema`'s of the same nodes)."""
    import pyarrow as pa

    if node.kind == "struct":
        return pa.struct([pa.field(name, arrow_type(sub)) for name, sub in node.fields])
    if node.kind == "list":
        assert node.element is not None
        return pa.list_(arrow_type(node.element))
    return {"string": pa.string(), "json": pa.string(), "long": pa.int64(), "double": pa.float64(),
            "boolean": pa.bool_()}[node.kind]


# --- values ------------------------------------------------------------------------


def converter(node: Node | None) -> Callable[[Any], Any] | None:
    """Turns a parsed output into the `output` column's value: longs checked to be whole,
    values without one clear type written as JSON text; None when every value goes in as
    it is (strings, doubles, booleans and structs and lists of them)."""
    return None if node is None else _converter(node, "output")


def output_values(rows: Sequence[Any], convert: Callable[[Any], Any] | None, version: str) -> list[Any]:
    """The `output` column's values for stored results (`converter`'s conversion applied); a value
    the column cannot take is refused with one line naming its record."""
    return converted_outputs([r.record_id for r in rows], [r.output for r in rows], convert, version)


def converted_outputs(ids: Sequence[str], outputs: Sequence[str], convert: Callable[[Any], Any] | None,
                      version: str) -> list[Any]:
    """`output_values` for outputs given as their records' ids and JSON texts, a list each."""
    import orjson

    loads = orjson.loads
    if convert is None:
        return [loads(o) for o in outputs]
    try:
        return [convert(loads(o)) for o in outputs]
    except BatchlineError:
        for record_id, o in zip(ids, outputs, strict=True):  # again, one at a time, to name the record
            try:
                convert(loads(o))
            except BatchlineError as exc:
                raise BatchlineError(f"{version}: record {record_id!r}: {exc}") from None
        raise


def _converter(node: Node, where: str) -> Callable[[Any], Any] | None:
    """None when the value goes into Arrow as it is (pyarrow converts strings, doubles and
    booleans itself), so an output made only of those costs nothing here."""
    if node.kind == "json":
        return lambda v: None if v is None else json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    if node.kind == "long":
        def to_long(v: Any) -> Any:
            # pyarrow would truncate 1.5 into a long column without a word.
            if isinstance(v, float):
                if not v.is_integer():
                    raise BatchlineError(f"{where} = {v!r} is not a whole number for a long column")
                return int(v)
            return v
        return to_long
    if node.kind == "list":
        assert node.element is not None
        inner = _converter(node.element, f"{where}[]")
        if inner is None:
            return None
        conv = inner
        return lambda v: None if v is None else [conv(x) for x in v]
    if node.kind == "struct":
        parts = [(name, c) for name, sub in node.fields if (c := _converter(sub, f"{where}.{name}")) is not None]
        if not parts:
            return None

        def to_struct(v: Any) -> Any:
            if not isinstance(v, dict):
                return v
            out = dict(v)
            for name, c in parts:
                if name in out:
                    out[name] = c(out[name])
            return out
        return to_struct
    return None
