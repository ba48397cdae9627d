"""The job spec as a JSON Schema, made from the parser's own field declarations.

Editors complete and check job files with it (the YAML language server:
`# yaml-language-server: $schema=job-spec.schema.json` on a spec's first line, after
`batchline spec-schema > job-spec.schema.json`). Each section allows exactly the keys
the parser allows (`batchline.spec.parse.SECTIONS`, and each source's and target's own
keys), so an unknown key is an error in both. What only reading the files can tell (a
prompt file that exists, one input key of several, a schema that is valid) is the
parser's alone: the schema accepts every spec the parser accepts, and names every key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from batchline.version import __version__

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def spec_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec, as this release's parser reads one."""
    from batchline.spec.parse import SECTIONS

    def nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
        # An optional key may be written and left empty (`validate:`); the parser takes that as unset.
        return {"anyOf": [dict(schema), {"type": "null"}]}

    def section(path: str) -> dict[str, Any]:
        fields, required = SECTIONS[path]
        properties: dict[str, Any] = {}
        for key, declared in fields().items():
            child = f"{path}.{key}" if path else key
            if child in SECTIONS:
                value = section(child)
            elif f"{child}.*" in SECTIONS:
                value = {"type": "object", "additionalProperties": section(f"{child}.*")}
            else:
                value = dict(declared)
            if "description" in declared:
                value["description"] = declared["description"]
            properties[key] = value if key in required else nullable(value)
        out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            out["required"] = sorted(required)
        return out

    schema = section("")
    return {"$schema": SCHEMA_DIALECT, "title": f"batchline {__version__} job spec",
            "description": "A batchline job: its input, model, prompt, decoding, output and checks.", **schema}


def render() -> str:
    return json.dumps(spec_schema(), indent=2, sort_keys=False) + "\n"
