"""Reading a spec section: small typed accessors that name the offending field in every
error, for the core's sections and for each plug-in's own (a source's, a target's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from batchline.errors import SpecError, one_line

__all__ = ["Fields", "ParseContext", "SpecReader", "one_line"]

# A section's fields, each with the JSON Schema of its value: the parser allows exactly these
# keys, and the spec's JSON Schema (batchline.spec.schema) is made from the same mapping.
Fields = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ParseContext:
    """What a family's parser (a source's, a target's) needs besides its own section."""

    base_dir: Path  # relative paths in a spec are relative to its file
    storage: Mapping[str, Any]  # input.storage: where the object store is
    # The spec is a planned job's stored form: locations are already resolved, listed and
    # expanded, and are taken as they are (nothing is read again).
    resolved: bool = False


class SpecReader:
    """Reads one spec file (`where` names it in every error)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field_name: str, message: str) -> NoReturn:
        raise SpecError(f"{self.where}: {field_name}: {message}")

    def section(self, value: Any, name: str, fields: Fields, *, required: set[str] | None = None) -> dict[str, Any]:
        """A mapping whose keys are `fields` (the section's declared fields)."""
        return self.mapping(value, name, required=required, allowed=set(fields))

    def mapping(self, value: Any, name: str, *, required: set[str] | None = None,
                allowed: set[str]) -> dict[str, Any]:
        label = name or "(top level)"
        if not isinstance(value, dict):
            self.fail(label, "must be a mapping")
        for key in value:
            if key not in allowed:
                full = f"{name}.{key}" if name else str(key)
                self.fail(full, f"unknown field (allowed: {', '.join(sorted(allowed))})")
        for key in sorted(required or ()):
            if key not in value or value[key] is None:
                self.fail(f"{name}.{key}" if name else key, "is required")
        return value
    def string(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or not value:
            self.fail(name, "must be a non-empty string")
        return str(value)

    def optional_string(self, value: Any, name: str) -> str | None:
        return None if value is None else self.string(value, name)

    def integer(self, value: Any, name: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(name, f"must be an integer, not {value!r}")
        if value < minimum:
            self.fail(name, f"must be at least {minimum}")
        return int(value)

    def optional_int(self, value: Any, name: str, minimum: int) -> int | None:
        return None if value is None else self.integer(value, name, minimum)

    def string_list(self, value: Any, name: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(name, f"must be a list of non-empty strings, not {value!r}")
        return list(value)

    def boolean(self, value: Any, name: str) -> bool:
        if not isinstance(value, bool):
            self.fail(name, f"must be true or false, not {value!r}")
        return value

    def number(self, value: Any, name: str, minimum: float, maximum: float | None = None) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(name, f"must be a number, not {value!r}")
        if maximum is not None and not minimum <= value <= maximum:
            self.fail(name, f"must be between {minimum:g} and {maximum:g}, not {value!r}")
        if value < minimum:
            self.fail(name, f"must be at least {minimum}")
        return float(value)
