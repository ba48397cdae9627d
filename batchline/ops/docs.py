"""The documentation's generated parts, rendered from the code so that the two cannot drift.

A page under docs/ holds each generated part between two markers that name it:

    <!-- generated: NAME (by `make docs`; a test fails when it differs from the code) -->
    ...
    <!-- end of NAME -->

`make docs` (`python -m batchline.cli.usage --write docs`) renders every part; `--check`
exits 1 when a page holds a part that differs. The command line's parts are rendered by
batchline.cli.usage, which sits above this layer with the parser; the others are here:
the job spec's fields (the parser's declarations), each engine's options (its module's
`OPTIONS`), the registry's members and the import contracts' layers (pyproject.toml).
"""

from __future__ import annotations

import functools
import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Renderers = Mapping[str, Callable[[], str]]

_BEGIN = "<!-- generated: {name} (by `make docs`; a test fails when it differs from the code) -->"
_END = "<!-- end of {name} -->"
_PART = re.compile(r"<!-- generated: (?P<name>[\w:.-]+) \(.*?\) -->\n.*?<!-- end of (?P=name) -->", re.DOTALL)


def block(name: str, body: str) -> str:
    """The part `name` as a page holds it, markers included."""
    return f"{_BEGIN.format(name=name)}\n\n{body.strip(chr(10))}\n\n{_END.format(name=name)}"


def parts_in(text: str) -> list[str]:
    return [m.group("name") for m in _PART.finditer(text)]


def filled(text: str, renderers: Renderers, where: str) -> str:
    """`text` with each generated part it holds rendered again."""

    def render(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in renderers:
            raise SystemExit(f"{where}: no generated part is called {name!r} (known: {', '.join(sorted(renderers))})")
        return block(name, renderers[name]())

    return _PART.sub(render, text)


def pages(docs: Path) -> list[Path]:
    return sorted(docs.rglob("*.md"))


@dataclass(frozen=True)
class Outcome:
    stale: list[Path]  # pages whose generated parts differ from the code
    unplaced: list[str]  # parts no page holds


def render_pages(docs: Path, renderers: Renderers, *, write: bool) -> Outcome:
    """Renders every page's parts; with `write`, puts the rendered parts into the pages."""
    stale: list[Path] = []
    placed: set[str] = set()
    for page in pages(docs):
        text = page.read_text(encoding="utf-8")
        placed.update(parts_in(text))
        updated = filled(text, renderers, str(page))
        if updated != text:
            stale.append(page)
            if write:
                page.write_text(updated, encoding="utf-8")
    return Outcome(stale, sorted(set(renderers) - placed))


# --- the job spec's fields ------------------------------------------------------------------


def _anchor(path: str) -> str:
    return "spec-" + (path.replace(".*", "").replace(".", "-") or "top")


def _title(path: str) -> str:
    return "the top level" if not path else f"`{path.replace('*', 'ROUTE')}`"


def type_text(schema: Mapping[str, Any], section: str | None = None) -> str:
    """A value's JSON Schema in words: `integer ≥ 1`, `one of jsonl, csv`."""
    if section is not None:
        return f"[section](#{_anchor(section)})"
    if "anyOf" in schema:
        return " or ".join(type_text(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        items = type_text(schema.get("items", {}))
        return f"list of {items}s" if items.isalpha() else f"list of ({items})"
    if kind == "object":
        return "mapping"
    bounds = [f"≥ {schema['minimum']:g}" if "minimum" in schema else "",
              f"> {schema['exclusiveMinimum']:g}" if "exclusiveMinimum" in schema else "",
              f"≤ {schema['maximum']:g}" if "maximum" in schema else ""]
    if "pattern" in schema and kind == "string":
        bounds.append(f"matching `{schema['pattern']}`")
    return " ".join([str(kind or "any value"), *[b for b in bounds if b]])


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    return f"`{value}`"


def _table(rows: Iterable[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | value | default | what it is |", "| --- | --- | --- | --- |"]
    lines += [f"| `{key}` | {kind} | {default} | {what} |" for key, kind, default, what in rows]
    return lines


def _row(key: str, schema: Mapping[str, Any], required: Iterable[str],
         section: str | None) -> tuple[str, str, str, str]:
    default = "required" if key in required else (_value(schema["default"]) if "default" in schema else "")
    return key, type_text(schema, section), default, str(schema.get("description", "")).replace("|", "\\|")


def spec_reference() -> str:
    """Every section of the job spec, with each key's value, default and description, as the
    parser declares them (batchline.spec.parse.SECTIONS, and each source's and target's keys)."""
    from batchline.spec.parse import SECTIONS

    out: list[str] = []
    for path, (fields_of, required) in SECTIONS.items():
        out += [f"### {_title(path)} {{ #{_anchor(path)} }}", ""]
        nested: list[tuple[str, Mapping[str, Any]]] = []
        rows = []
        for key, schema in fields_of().items():
            child = f"{path}.{key}" if path else key
            section = child if child in SECTIONS else f"{child}.*" if f"{child}.*" in SECTIONS else None
            if schema.get("type") == "object" and "properties" in schema:
                nested.append((child, schema))
                section = child
            rows.append(_row(key, schema, required, section))
        out += [*_table(rows), ""]
        for child, schema in nested:
            out += [f"#### `{child}` {{ #{_anchor(child)} }}", "", str(schema.get("description", "")), ""]
            out += [*_table(_row(k, s, schema.get("required", ()), None)
                            for k, s in schema["properties"].items()), ""]
            if schema.get("examples"):
                example = ", ".join(f"{k}: {v}" for k, v in schema["examples"][0].items())
                out += [f"For example `{child.split('.')[-1]}: {{{example}}}`.", ""]
    return "\n".join(out)


# --- the registry ---------------------------------------------------------------------------------


def registry_members() -> str:
    """Every member of the registry's tables: its name, the module that provides it, its extra."""
    from batchline.registry import TABLES

    lines = ["| table | name | module | extra |", "| --- | --- | --- | --- |"]
    for table, members in TABLES.items():
        for member in members.values():
            module = member.target.split(":")[0]
            path = module.replace(".", "/") + ".py"
            lines.append(f"| `{table}` | `{member.name}` | `{path}` | {f'`{member.extra}`' if member.extra else ''} |")
    return "\n".join(lines)


# --- each engine's options ---------------------------------------------------------------------


def _default(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return f"`{json.dumps(value)}`" if value else "none"
    return _value(value)


def engine_options(engine: str) -> str:
    """The options an engine's module declares (its `OPTIONS`): each one's value, default and
    what it does."""
    from batchline.registry import ENGINES

    lines = ["| option | value | default | what it does |", "| --- | --- | --- | --- |"]
    for o in ENGINES[engine].options().values():
        kind = "one of " + ", ".join(f"`{c}`" for c in o.choices) if o.choices else o.type
        default = o.default_text if o.default_text is not None else _default(o.default)
        lines.append(f"| `{o.name}` | {kind} | {default} | {o.description.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


# --- the layers the import contracts enforce -------------------------------------------------


def layers(pyproject: Path) -> str:
    """The import contracts of `pyproject` ([tool.importlinter]) drawn: the layers from the
    top down, then what the forbidden contracts keep apart, and the imports they allow."""
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["importlinter"]
    out: list[str] = []
    for contract in config["contracts"]:
        out += [f"**{contract['name']}.**", ""]
        if contract["type"] == "layers":
            stack = [str(layer).split(" | ") for layer in contract["layers"]]
            width = max(len("   ".join(layer)) for layer in stack) + 4
            drawing = []
            for i, layer in enumerate(stack):
                drawing.append("+" + "-" * width + "+")
                drawing.append("|  " + "   ".join(layer).ljust(width - 2) + "|")
                if i == len(stack) - 1:
                    drawing.append("+" + "-" * width + "+")
            out += ["```text", *drawing, "```", "",
                    "Each layer may import only the layers below it; modules side by side in one layer "
                    "import neither each other nor anything above.", ""]
        elif contract["type"] == "forbidden":
            out += ["These modules:", "", _names(contract["source_modules"]), "",
                    "import none of these:", "", _names(contract["forbidden_modules"]), ""]
        for allowed in contract.get("ignore_imports", ()):
            importer, imported = (part.strip() for part in allowed.split("->"))
            out += [f"- allowed: `{importer}` imports `{imported}`"]
        if contract.get("ignore_imports"):
            out.append("")
    return "\n".join(out)


def _names(modules: Iterable[str]) -> str:
    return ", ".join(f"`{m}`" for m in modules)


def renderers(root: Path) -> dict[str, Callable[[], str]]:
    """This layer's parts, for the checkout at `root`."""
    from batchline.registry import ENGINES

    return {
        "spec-reference": spec_reference,
        "registry": registry_members,
        "layers": lambda: layers(root / "pyproject.toml"),
        **{f"engine-options:{name}": functools.partial(engine_options, name) for name in ENGINES},
    }
