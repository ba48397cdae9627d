"""The package's layers, checked from its imports: no modules import each other in a circle,
and the import contracts (pyproject.toml, run as lint-imports) cover every plug-in."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchline"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(*, at_load: bool = False, typing: bool = True) -> dict[str, set[str]]:
    """Each module's imports of other batchline modules. `at_load`: only those that run when
    the module is loaded (not inside functions, nor under TYPE_CHECKING); `typing`: with those
    under TYPE_CHECKING (types in annotations) too."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped: set[int] = set()
        if not typing:
            for node in ast.walk(tree):
                if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    skipped.update(id(n) for n in ast.walk(node))
        found: set[str] = set()
        for node in (tree.body if at_load else ast.walk(tree)):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(t for t in targets if t in modules and t != name)
        out[name] = found
    return out


def without_own_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package imports its own modules in __init__ and they import their siblings through it;
    # that is not a circle between concerns, so an edge to a module's own package is left out.
    return {m: {t for t in deps if not m.startswith(t + ".") and not (m + ".").startswith(t + ".")}
            for m, deps in graph.items()}


def subpackages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the package's parts (batchline.spec, batchline.sources, ...)."""
    def part(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m == "batchline":
            continue
        out.setdefault(part(m), set()).update(part(d) for d in deps if d != "batchline" and part(d) != part(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    # Every import that runs, when a module loads or inside a function.
    assert cycles(without_own_packages(imports(typing=False))) == []


def test_no_parts_of_the_package_import_each_other_in_a_circle_counting_typing_imports() -> None:
    # Between the package's parts, an import for a type is an arrow too: the spec once named its
    # sources' and targets' types under TYPE_CHECKING while they imported it.
    assert cycles(subpackages(imports())) == []


def test_the_worker_runs_do_not_import_each_other_or_the_supervisor() -> None:
    graph = imports()
    for run in ("batchline.worker.local", "batchline.worker.hosted"):
        assert not graph[run] & {"batchline.worker.supervisor", "batchline.worker.local",
                                 "batchline.worker.hosted"}


def test_every_registry_member_is_a_plug_in_the_core_may_not_import() -> None:
    # The import contracts in pyproject.toml (run by `make test` as lint-imports) name the
    # plug-in modules the core may not import; a member added to a registry table without
    # being added there would slip through them.
    import tomllib

    from batchline.registry import TABLES

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    [core] = [c for c in config["contracts"] if c["name"].startswith("The core imports no plug-in")]
    members = {entry.target.split(":")[0] for table in TABLES.values() for entry in table.values()}
    assert members <= set(core["forbidden_modules"])
    assert not members & set(core["source_modules"])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_module_outside_the_families_names_a_member_of_theirs() -> None:
    # A member is found by what a spec names or a caller chooses (TABLE[name]), never by its own
    # name written into the core: `TARGETS["lancedb"]` in the API is what made a second
    # searchable target an edit of the API and the command line.
    from batchline.registry import TABLES

    families = ("engines", "providers", "sources", "targets")
    named = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in families or parts == ("registry.py",):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in TABLES
                    and isinstance(node.slice, ast.Constant)):
                named.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value.id}[{node.slice.value!r}]")
    assert named == []
