"""The docs' generated parts are what the code renders (the command line from the parser, the
spec's fields from the parser's declarations, the registry, the import contracts' layers), so
the two cannot drift; and every path the docs name is in the checkout."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from batchline.cli import usage
from batchline.ops import docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_every_generated_part_of_the_docs_is_what_the_code_renders() -> None:
    outcome = docs.render_pages(DOCS, usage.renderers(), write=False)
    assert outcome.stale == [], "the docs differ from the code: run `make docs`"
    assert outcome.unplaced == []


def test_check_fails_on_a_stale_part_and_write_renders_it(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    shutil.copytree(DOCS, folder)
    page = folder / "reference" / "cli.md"
    fresh = page.read_text()
    page.write_text(fresh.replace("batchline run [--store URL]", "batchline run JOB.yaml [--store URL]"))
    assert usage.main(["--check", str(folder)]) == 1
    assert usage.main(["--write", str(folder)]) == 0
    assert usage.main(["--check", str(folder)]) == 0
    assert page.read_text() == fresh


def test_check_fails_when_no_page_holds_a_part(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    shutil.copytree(DOCS, folder)
    page = folder / "reference" / "cli.md"
    page.write_text(re.sub(r"<!-- generated: environment .*?<!-- end of environment -->", "", page.read_text(),
                           flags=re.DOTALL))
    assert usage.main(["--check", str(folder)]) == 1


def test_a_page_naming_a_part_nobody_renders_is_refused(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text(f"# x\n\n{docs.block('nonesuch', 'old')}\n")
    with pytest.raises(SystemExit, match="no generated part is called 'nonesuch'"):
        docs.render_pages(tmp_path, usage.renderers(), write=False)


def test_the_cli_reference_names_the_options_a_hand_kept_table_had_missed() -> None:
    page = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    for usage_part in ("batchline run [--store URL] [--workers N] [--log-dir DIR] [--publish]",
                       "batchline rollback [--store URL] [--reason REASON] NAME", "[--watch] [--interval SECONDS]",
                       "[--poll-seconds SECONDS] [--store-wait SECONDS]", "[--metrics-addr ADDR]",
                       "`BATCHLINE_LOG_DIR`"):
        assert usage_part in page


def test_every_environment_variable_the_package_reads_is_in_the_table() -> None:
    read = {m for path in (ROOT / "batchline").rglob("*.py")
            for m in re.findall(r"\bBATCHLINE_[A-Z_]+\b", path.read_text(encoding="utf-8"))}
    assert read == set(usage.ENVIRONMENT)


def test_the_layers_drawn_are_the_contracts_layers(tmp_path: Path) -> None:
    drawn = docs.layers(ROOT / "pyproject.toml")
    assert drawn.index("batchline.cli ") < drawn.index("batchline.api ") < drawn.index("batchline.store ")
    # Another order of layers in the contracts is another drawing.
    moved = (ROOT / "pyproject.toml").read_text().replace(
        '  "batchline.cli | batchline.orchestrators",\n  "batchline.api",\n',
        '  "batchline.api",\n  "batchline.cli | batchline.orchestrators",\n')
    (tmp_path / "pyproject.toml").write_text(moved)
    redrawn = docs.layers(tmp_path / "pyproject.toml")
    assert redrawn != drawn
    assert redrawn.index("batchline.api ") < redrawn.index("batchline.cli ")


def declared_fields() -> list[tuple[str, dict[str, Any]]]:
    from batchline.spec.parse import SECTIONS

    out = []
    for path, (fields_of, _required) in SECTIONS.items():
        for key, schema in fields_of().items():
            out.append((f"{path}.{key}".lstrip("."), dict(schema)))
            for sub, sub_schema in schema.get("properties", {}).items():
                out.append((f"{path}.{key}.{sub}", dict(sub_schema)))
    return out


def test_every_spec_field_the_reference_lists_has_a_description() -> None:
    undescribed = [where for where, schema in declared_fields() if not schema.get("description")]
    assert undescribed == []


def test_the_defaults_the_reference_shows_are_the_ones_the_parser_applies(tmp_path: Path) -> None:
    from batchline.spec import parse_spec

    (tmp_path / "in.jsonl").write_text('{"id": "r1", "text": "hello"}\n')
    spec = parse_spec({"name": "defaults", "input": {"path": "in.jsonl"}, "model": {"engine": "synthetic"},
                       "prompt": {"text": "Say.\n", "version": 1}, "output": {"schema": {"type": "object"}},
                       "validate": {"eval": {"labels": "in.jsonl", "field": "x"}},
                       "routing": {"class_field": "c", "providers": {"p": {
                           "api": "openai", "model": "m", "classes": ["x"], "retention": "none"}}}}, tmp_path)
    where = {"input": spec.input, "decoding": spec.decoding, "shards": spec.shards, "validate": spec.validate,
             "validate.drift": spec.validate.drift, "validate.eval": spec.validate.grader("eval"),
             "retention": spec.retention, "routing.providers.*": spec.routing.providers[0] if spec.routing else None}
    from batchline.registry import FORMATS, loaded
    from batchline.spec.reader import SpecReader

    # A format's options are its own: given as its default, an option is as if not given.
    format_options = {key: fmt for fmt in loaded(FORMATS) for key in fmt.options}
    checked = 0
    for field, schema in declared_fields():
        section, _, key = field.rpartition(".")
        if "default" in schema and section == "input" and key in format_options:
            reader = format_options[key]
            assert reader.parse_options({key: schema["default"]}, "acl", SpecReader("t")) == \
                reader.parse_options({}, "acl", SpecReader("t")), field
            checked += 1
        elif "default" in schema and section in where:
            assert getattr(where[section], key) == schema["default"], field
            checked += 1
    assert checked >= 25


# A path in the checkout, as the docs write one in backticks (not a placeholder, not a glob).
REPO_PATH = re.compile(r"`((?:batchline|tests|bench|examples|container|docs)/[\w./-]*[\w/]|"
                       r"(?:Makefile|pyproject\.toml|mkdocs\.yml|BENCHMARKS\.md|CHANGELOG\.md|LICENSE))`")


def test_every_path_in_the_checkout_the_docs_name_is_there() -> None:
    texts = {page: page.read_text(encoding="utf-8") for page in [*docs.pages(DOCS), ROOT / "README.md"]}
    named = {(page.relative_to(ROOT), path) for page, text in texts.items() for path in REPO_PATH.findall(text)}
    assert named
    assert [(str(page), path) for page, path in sorted(named) if not (ROOT / path).exists()] == []


def test_the_readme_is_what_a_newcomer_reads_first_and_links_into_the_docs() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert "docs/index.md" in links
    assert [link for link in links if not (ROOT / link).exists()] == []


def nav_pages() -> list[str]:
    """Every page of the site's navigation (mkdocs.yml), as its path under docs/."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may hold !!python/name tags a safe loader refuses; the nav needs none of them.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)  # a safe loader

    def walk(items: Any) -> list[str]:
        out: list[str] = []
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += walk(value) if isinstance(value, list) else [str(value)]
        return out

    return walk(config["nav"])


def test_the_docs_index_is_the_one_table_of_contents_every_page_of_the_site_is_in() -> None:
    # The README points to the index instead of keeping its own list, so there is one to keep.
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", index))
    assert [page for page in nav_pages() if page != "index.md" and page not in linked] == []
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"^\s*[-*] \[[^]]*\]\(docs/", readme, re.MULTILINE) == []  # no list of its own


def test_the_python_reference_renders_every_public_name_of_the_api() -> None:
    import batchline.api

    page = (DOCS / "reference" / "python.md").read_text()
    rendered = set(re.findall(r"^::: ([\w.]+)$", page, re.MULTILINE))
    shown = {name.rsplit(".", 1)[-1] for name in rendered}
    assert [name for name in batchline.api.__all__ if name not in shown] == []


def test_getting_started_names_every_extra_and_every_method_of_the_api() -> None:
    import inspect
    import tomllib

    import batchline.api

    page = (DOCS / "getting-started.md").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [name for name in extras if name != "dev" and f"| `{name}` |" not in page] == []
    methods = [name for name, _ in inspect.getmembers(batchline.api.Jobs, inspect.isfunction)
               if not name.startswith("_") and name not in ("resolve", "validate_and_publish")]
    assert [name for name in methods if f"`{name}`" not in page] == []
