"""Checking a model's output against the job's JSON Schema."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema


class OutputChecker:
    def __init__(self, schema: Mapping[str, Any]) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema)

    def check(self, output: str) -> tuple[str | None, str | None]:
        """(canonical JSON, None) for a valid output; (None, reason) otherwise."""
        try:
            value = json.loads(output)
        except (json.JSONDecodeError, TypeError) as exc:
            return None, f"output is not JSON: {exc}"
        error = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return None, f"output fails the schema at {where}: {error.message}"
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None

    def is_valid(self, value: Any) -> bool:
        return bool(self._validator.is_valid(value))
