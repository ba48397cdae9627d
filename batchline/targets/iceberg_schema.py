"""The Iceberg table a job's results are published into: its columns' Iceberg types, from the
typed columns of `batchline.targets.columns` (the mapping the Parquet export uses too).

One row per record: `id`, `outcome` (`result` or `dead_letter`), the output's
fields as typed columns inside one struct column, `output`, the raw output as
JSON text, the record's ACL as a list of strings, the job version, the model
that answered, and for a dead letter its error kind and error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchline.targets.columns import (
    ACL,
    CARRY_COLUMN,
    JSON,
    ORIGIN_COLUMN,
    OUTPUT_COLUMN,
    PROVENANCE,
    PROVENANCE_COLUMN,
    Node,
    acl_values,
    carry_node,
    carry_values,
    converter,
    node_of,
    origin_values,
    output_node,
    output_values,
    provenance_values,
)

__all__ = [
    "ACL",
    "CARRY_COLUMN",
    "JSON",
    "ORIGIN_COLUMN",
    "OUTPUT_COLUMN",
    "PROVENANCE_COLUMN",
    "Node",
    "acl_is_text",
    "acl_values",
    "carry_node",
    "carry_values",
    "converter",
    "iceberg_schema",
    "node_of",
    "origin_values",
    "output_node",
    "output_values",
    "provenance_values",
    "schema_change",
]


def iceberg_schema(schema: Mapping[str, Any], *, acl_text: bool = False, carry: Sequence[str] = (),
                   provenance: bool = False) -> Any:
    """The table's schema for an output schema (field ids are assigned again by the catalog);
    `acl_text`: the table's `acl` column is JSON text (made before ACLs were lists)."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import IntegerType, LongType, NestedField, StringType, TimestamptzType

    ids = iter(range(1, 1 << 30))
    columns: list[tuple[str, Any]] = [("id", StringType()), ("outcome", StringType())]
    node = output_node(schema)
    if node is not None:
        columns.append((OUTPUT_COLUMN, _iceberg_type(node, ids)))
    columns += [("raw_output", StringType()), ("acl", StringType() if acl_text else _iceberg_type(ACL, ids)),
                ("version", StringType()), (ORIGIN_COLUMN, StringType()),
                ("model", StringType()), ("label", StringType()), ("attempt", IntegerType()),
                ("input_tokens", LongType()), ("output_tokens", LongType()), ("created_at", TimestamptzType()),
                ("error_kind", StringType()), ("error", StringType())]
    carried = carry_node(carry)
    if carried is not None:
        columns.append((CARRY_COLUMN, _iceberg_type(carried, ids)))
    if provenance:
        columns.append((PROVENANCE_COLUMN, _iceberg_type(PROVENANCE, ids)))
    return Schema(*(NestedField(next(ids), name, t, required=False) for name, t in columns))


def acl_is_text(table_schema: Any) -> bool:
    """Whether a table's `acl` column is JSON text: a table made before ACLs were lists keeps it."""
    from pyiceberg.types import StringType

    try:
        return isinstance(table_schema.find_field("acl").field_type, StringType)
    except ValueError:
        return False


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
