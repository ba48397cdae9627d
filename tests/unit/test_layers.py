"""The package's layers, checked from its imports: no modules import each other in a circle,
and the import contracts (pyproject.toml, run as lint-imports) cover every plug-in."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchline"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(*, at_load: bool = False) -> dict[str, set[str]]:
    """Each module's imports of other batchline modules. `at_load`: only those that run when
    the module is loaded (not inside functions, nor under TYPE_CHECKING), which are the
    ones that make an import circle."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found: set[str] = set()
        for node in (tree.body if at_load else ast.walk(tree)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(t for t in targets if t in modules and t != name)
        out[name] = found
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
    # A package imports its own modules in __init__ and they import their siblings;
    # that is not a circle between concerns, so a package's own __init__ edges are left out.
    graph = {m: {t for t in deps if not m.startswith(t + ".") and not (m + ".").startswith(t + ".")}
             for m, deps in imports(at_load=True).items()}
    assert cycles(graph) == []


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

    from batchline.registry import ENGINES, PROVIDERS, SOURCES, TARGETS

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    [core] = [c for c in config["contracts"] if c["name"].startswith("The core imports no plug-in")]
    members = {entry.target.split(":")[0] for table in (ENGINES, PROVIDERS, SOURCES, TARGETS)
               for entry in table.values()}
    assert members <= set(core["forbidden_modules"])
    assert not members & set(core["source_modules"])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
