"""Checking a model's output against the job's JSON Schema.

`jsonschema` is the authority. Where a schema uses only keywords whose meaning
is the same in draft 7 and 2020-12, a compiled `fastjsonschema` validator
(about ten times faster) answers first, and only its rejections are checked
again by `jsonschema`, which also words the error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import jsonschema
import orjson

# Keywords fastjsonschema does not know or reads differently; a schema using any
# of them is checked by jsonschema alone.
_DRAFT_2019_ONWARD = {
    "prefixItems", "unevaluatedProperties", "unevaluatedItems", "dependentSchemas", "dependentRequired",
    "$dynamicRef", "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "minContains", "maxContains",
    "$anchor", "$vocabulary",
}


def _keywords(node: Any) -> set[str]:
    if isinstance(node, dict):
        out = set(node)
        for value in node.values():
            out |= _keywords(value)
        return out
    if isinstance(node, list):
        return set().union(*(_keywords(v) for v in node)) if node else set()
    return set()


def _fast_validator(schema: Mapping[str, Any]) -> Callable[[Any], bool] | None:
    if _keywords(schema) & _DRAFT_2019_ONWARD:
        return None
    try:
        import fastjsonschema

        draft7 = {k: v for k, v in schema.items() if k != "$schema"}
        compiled = fastjsonschema.compile(draft7)
    except Exception:  # any schema it cannot compile is left to jsonschema
        return None

    def is_valid(value: Any) -> bool:
        try:
            compiled(value)
        except fastjsonschema.JsonSchemaException:
            return False
        return True

    return is_valid


class OutputChecker:
    def __init__(self, schema: Mapping[str, Any]) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._validator = cls(schema)
        self._fast = _fast_validator(schema)

    def check(self, output: str) -> tuple[str | None, str | None]:
        """(canonical JSON, None) for a valid output; (None, reason) otherwise."""
        try:
            value = json.loads(output)
        except (json.JSONDecodeError, TypeError) as exc:
            return None, f"output is not JSON: {exc}"
        if self._fast is None or not self._fast(value):
            error = jsonschema.exceptions.best_match(self._validator.iter_errors(value))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(root)"
                return None, f"output fails the schema at {where}: {error.message}"
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")), None

    def problem(self, output: str) -> str | None:
        """Why a stored output is not valid against the schema, or None: `check`'s verdict,
        without making its canonical form (the gate re-reads every output of a version)."""
        try:
            value = orjson.loads(output)
        except orjson.JSONDecodeError:
            return self.check(output)[1]  # the standard parser's verdict and words
        if self._fast is not None and self._fast(value):
            return None
        return self.check(output)[1]

    def is_valid(self, value: Any) -> bool:
        if self._fast is not None and self._fast(value):
            return True
        return bool(self._validator.is_valid(value))
