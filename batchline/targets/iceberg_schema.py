"""The Iceberg table a job's results are published into: its columns, from the output's JSON Schema.

One row per record: `id`, `outcome` (`result` or `dead_letter`), the output's
fields as typed columns inside one struct column, `output` (so no output field
can collide with `id`, `acl` or `model`), the raw output as JSON text, the
record's ACL as JSON text, the job version, the model that answered, and for a
dead letter its error kind and error.

Types: a string enum or a string is a string, an object with properties a
struct, an array a list of its items' type, a number a double, an integer a
long, a boolean a boolean; anything without one clear type (no `type`, several
types, `oneOf`, `anyOf`, `allOf`, `$ref`, an object without properties) is a
string holding its JSON. `"type": ["X", "null"]` is X (every column may be null).
"""

from __future__ import annotations

import json
from collections.abc import Callable
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


def output_node(schema: dict[str, Any]) -> Node | None:
    """The `output` struct column, or None when the output is not an object with properties."""
    node = node_of(schema)
    return node if node.kind == "struct" else None


# --- pyiceberg types -------------------------------------------------------------


def iceberg_schema(schema: dict[str, Any]) -> Any:
    """The table's schema for an output schema (field ids are assigned again by the catalog)."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import IntegerType, LongType, NestedField, StringType, TimestamptzType

    ids = iter(range(1, 1 << 30))
    columns: list[tuple[str, Any]] = [("id", StringType()), ("outcome", StringType())]
    node = output_node(schema)
    if node is not None:
        columns.append((OUTPUT_COLUMN, _iceberg_type(node, ids)))
    columns += [("raw_output", StringType()), ("acl", StringType()), ("version", StringType()),
                ("model", StringType()), ("label", StringType()), ("attempt", IntegerType()),
                ("input_tokens", LongType()), ("output_tokens", LongType()), ("created_at", TimestamptzType()),
                ("error_kind", StringType()), ("error", StringType())]
    return Schema(*(NestedField(next(ids), name, t, required=False) for name, t in columns))


def _iceberg_type(node: Node, ids: Any) -> Any:
    from pyiceberg.types import (
        BooleanType,
        DoubleType,
        ListType,
        LongType,
        NestedField,
        StringType,
        StructType,
    )

    if node.kind == "struct":
        return StructType(*(NestedField(next(ids), name, _iceberg_type(sub, ids), required=False)
                            for name, sub in node.fields))
    if node.kind == "list":
        assert node.element is not None
        return ListType(next(ids), _iceberg_type(node.element, ids), element_required=False)
    return {"string": StringType(), "json": StringType(), "long": LongType(), "double": DoubleType(),
            "boolean": BooleanType()}[node.kind]


def schema_change(table_schema: Any, wanted: Any, *, missing_ok: bool = False) -> str | None:
    """What about `wanted` is not an additive change of the table's schema (a column whose
    type changed, or that is gone), as one line naming the column; None when it only adds.
    `missing_ok`: a column the table has and `wanted` lacks is fine (it is left empty)."""
    return _struct_change(table_schema.as_struct(), wanted.as_struct(), "", missing_ok)


def _struct_change(have: Any, want: Any, prefix: str, missing_ok: bool) -> str | None:
    wanted = {f.name: f.field_type for f in want.fields}
    for field in have.fields:
        name = f"{prefix}{field.name}"
        if field.name not in wanted:
            if missing_ok:
                continue
            return f"column {name} ({_type_name(field.field_type)}) is in the table but not in this version's output"
        change = _type_change(field.field_type, wanted[field.name], name, missing_ok)
        if change:
            return change
    return None


def _type_change(have: Any, want: Any, name: str, missing_ok: bool) -> str | None:
    from pyiceberg.types import ListType, StructType

    if isinstance(have, StructType) and isinstance(want, StructType):
        return _struct_change(have, want, f"{name}.", missing_ok)
    if isinstance(have, ListType) and isinstance(want, ListType):
        return _type_change(have.element_type, want.element_type, f"{name}[]", missing_ok)
    if type(have) is not type(want):
        return f"column {name} is {_type_name(have)} in the table and {_type_name(want)} in this version's output"
    return None


def _type_name(t: Any) -> str:
    from pyiceberg.types import ListType, StructType

    if isinstance(t, StructType):
        return "struct"
    if isinstance(t, ListType):
        return f"list<{_type_name(t.element_type)}>"
    return str(t)


# --- values ------------------------------------------------------------------------


def converter(node: Node | None) -> Callable[[Any], Any] | None:
    """Turns a parsed output into the `output` column's value: longs checked to be whole,
    values without one clear type written as JSON text; None when every value goes in as
    it is (strings, doubles, booleans and structs and lists of them)."""
    return None if node is None else _converter(node, "output")


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
