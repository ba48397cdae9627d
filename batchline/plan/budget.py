"""Whether `decoding.max_tokens` can hold the output the schema asks for, before anything runs.

An output cut off at `max_tokens` is not valid JSON, so a budget too small for the schema
turns records into dead letters (or, under constrained decoding, into truncated text that
happens to close). The output's size is measured in UTF-8 bytes of its compact JSON:

- the largest: every property present, every string at its `maxLength` (one byte a
  character, which is what the example's ASCII answers take), every array at `maxItems`,
  an enum at its longest value; a string or array the schema does not bound counts at its
  minimum, so what is measured is what the schema bounds;
- the smallest: only the required properties, every string and array at its minimum.

Tokens are estimated from bytes at two rates: the planner's bound for input text,
`input.max_bytes_per_token` (no tokenizer puts more bytes into a token, so an output over
`max_tokens` at that rate can never fit: refused), and a typical rate of
`TYPICAL_BYTES_PER_TOKEN` for English and JSON under current tokenizers (an output over
`max_tokens` at that rate will often be cut off: a warning naming the fields).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from batchline.errors import SpecError
from batchline.registry import ENGINES
from batchline.spec import JobSpec

TYPICAL_BYTES_PER_TOKEN = 4
NUMBER_BYTES = (1, 20)  # the smallest and a generous largest number, in bytes


def output_bytes(schema: Any, largest: bool) -> int:
    """The compact JSON size of the largest or smallest output `schema` admits (see the module)."""
    if not isinstance(schema, Mapping):
        return 1
    if "const" in schema:
        return len(_compact(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        sizes = [len(_compact(v)) for v in schema["enum"]]
        return max(sizes) if largest else min(sizes)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            sizes = [output_bytes(s, largest) for s in schema[key]]
            return max(sizes) if largest else min(sizes)
    kinds = schema.get("type")
    kind = kinds if isinstance(kinds, str) else (kinds[0] if isinstance(kinds, list) and kinds else None)
    if kind == "object" or (kind is None and "properties" in schema):
        found = schema.get("properties")
        properties: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        required = set(schema.get("required") or [])
        shown = [k for k in properties if largest or k in required]
        body = sum(len(_compact(k)) + 1 + output_bytes(properties[k], largest) for k in shown)
        return 2 + body + max(len(shown) - 1, 0)
    if kind == "array":
        count = _bound(schema, "maxItems", "minItems", largest)
        item = output_bytes(schema.get("items", {}), largest) if count else 0
        return 2 + count * item + max(count - 1, 0)
    if kind == "string":
        return 2 + _bound(schema, "maxLength", "minLength", largest)
    if kind in ("number", "integer"):
        return NUMBER_BYTES[1] if largest else NUMBER_BYTES[0]
    if kind == "boolean":
        return 5 if largest else 4
    if kind == "null":
        return 4
    return 1


def _bound(schema: Mapping[str, Any], most: str, least: str, largest: bool) -> int:
    """The schema's upper bound where `largest` and it has one, else its lower bound (or 0)."""
    upper = schema.get(most)
    if largest and isinstance(upper, int):
        return upper
    lower = schema.get(least)
    return lower if isinstance(lower, int) else 0


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _bounded_strings(schema: Any, path: str = "output") -> list[str]:
    """The fields whose strings the schema bounds by maxLength (what a warning names)."""
    if not isinstance(schema, Mapping):
        return []
    if schema.get("type") == "string" and isinstance(schema.get("maxLength"), int):
        return [f"{path} (maxLength {schema['maxLength']})"]
    out: list[str] = []
    for name, sub in (schema.get("properties") or {}).items():
        out += _bounded_strings(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), Mapping):
        out += _bounded_strings(schema["items"], f"{path}[]")
    return out


def check_output_budget(spec: JobSpec) -> str | None:
    """Refuses (SpecError) a `decoding.max_tokens` that cannot hold the smallest output the
    schema admits; returns a warning where it cannot hold the largest the schema bounds."""
    if not ENGINES[spec.model.engine].knobs:  # an engine that does not decode has no token budget
        return None
    budget = spec.decoding.max_tokens
    smallest = output_bytes(spec.output_schema, largest=False)
    if math.ceil(smallest / spec.input.max_bytes_per_token) > budget:
        raise SpecError(f"decoding.max_tokens: {budget} cannot hold even the smallest output the schema admits "
                        f"({smallest} bytes of JSON, at least {math.ceil(smallest / spec.input.max_bytes_per_token)} "
                        f"tokens at {spec.input.max_bytes_per_token} bytes a token); raise it")
    largest = output_bytes(spec.output_schema, largest=True)
    needed = math.ceil(largest / TYPICAL_BYTES_PER_TOKEN)
    if needed <= budget:
        return None
    fields = ", ".join(_bounded_strings(spec.output_schema)) or "its fields"
    return (f"warning: decoding.max_tokens {budget} may cut off outputs: the largest output the schema bounds "
            f"({fields}) is {largest} bytes of JSON, about {needed} tokens at {TYPICAL_BYTES_PER_TOKEN} bytes a "
            f"token; raise max_tokens to {needed} or more, or lower those maxLength bounds")
