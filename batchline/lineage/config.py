"""Whether lineage is on in this process, read the way the OpenLineage client reads it.

Lineage is on when the environment or a file configures a transport: `OPENLINEAGE_URL`
(HTTP), `OPENLINEAGE__TRANSPORT__...` variables, or an `openlineage.yml` found where the
client looks (`OPENLINEAGE_CONFIG`, the working folder, `~/.openlineage/`).
`OPENLINEAGE_DISABLED=true` turns it off whatever is configured. With nothing
configured it is off, and neither the client nor anything else is imported.

The client itself logs a configuration file it cannot read and goes on without it
(printing events to the console); here such a file is refused instead, in one line that
names it, before a command does anything: a job whose lineage silently went nowhere
would be worse than one that does not start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError, one_line

# Where the client looks for its file, in its order.
CONFIG_VARIABLE = "OPENLINEAGE_CONFIG"
CONFIG_NAME = "openlineage.yml"
# The namespace of the jobs batchline reports (each dataset's namespace is its datasource's).
NAMESPACE_VARIABLE = "OPENLINEAGE_NAMESPACE"
DEFAULT_NAMESPACE = "batchline"


class LineageConfigError(BatchlineError):
    """The OpenLineage configuration cannot be read as the client would need it: 2, as for
    any other configuration a command is given that cannot be what was meant."""

    exit_code = 2


@dataclass(frozen=True)
class LineageConfig:
    """Lineage is on: where its configuration came from, and the jobs' namespace."""

    source: str  # the file, or the variables, that configure the transport
    namespace: str
    path: Path | None = None

    def client(self) -> Any:
        """The OpenLineage client this configuration makes (imported only now)."""
        from openlineage.client import OpenLineageClient

        before = dict(os.environ)
        try:
            return OpenLineageClient()
        except Exception as exc:  # the client raises what its transports do: say it in one line
            raise LineageConfigError(f"OpenLineage configuration ({self.source}): {one_line(exc)}") from None
        finally:
            # The client writes OPENLINEAGE_URL's aliases into the environment as it reads it:
            # a worker this process starts later would inherit a half configuration.
            for key in set(os.environ) - set(before):
                del os.environ[key]
            for key, value in before.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


def _file() -> Path | None:
    explicit = os.environ.get(CONFIG_VARIABLE)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise LineageConfigError(f"{CONFIG_VARIABLE}={explicit}: no such file")
        return path
    for candidate in (Path.cwd() / CONFIG_NAME, Path("~/.openlineage").expanduser() / CONFIG_NAME):
        if candidate.is_file():
            return candidate
    return None


def _transport_variables() -> bool:
    """Whether the variables configure a transport; some of a transport's variables without
    its type configure none (the client would print events to its console) and are refused."""
    if os.environ.get("OPENLINEAGE_URL") or os.environ.get("OPENLINEAGE__TRANSPORT__TYPE"):
        return True
    partial = sorted(k for k in os.environ if k.startswith("OPENLINEAGE__TRANSPORT__"))
    if partial:
        raise LineageConfigError(f"{partial[0]} is set without OPENLINEAGE__TRANSPORT__TYPE: the transport has no "
                                 "type (http, kafka, file, ...), so lineage would go nowhere")
    return False


def _check_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LineageConfigError(f"{path}: cannot be read ({one_line(exc)})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or one_line(exc)
        raise LineageConfigError(f"{path}: not valid YAML{where} ({problem})") from None
    if content is None:
        raise LineageConfigError(f"{path}: the file is empty; configure a transport, or remove the file")
    if not isinstance(content, dict):
        raise LineageConfigError(f"{path}: must be a mapping with a `transport`, not {type(content).__name__}")
    transport = content.get("transport")
    if transport is not None and (not isinstance(transport, dict) or not isinstance(transport.get("type"), str)):
        raise LineageConfigError(f"{path}: transport must be a mapping with a `type` (http, kafka, file, ...)")
    return content


def lineage_config() -> LineageConfig | None:
    """This process's lineage configuration, or None when lineage is off. A configuration
    that is there but malformed is refused with one line naming it (`LineageConfigError`)."""
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return None
    path = _file()
    content = _check_file(path) if path is not None else {}
    if "transport" in content:
        if content["transport"].get("type") == "noop":
            return None
        source = str(path)
    elif _transport_variables():
        source = "OPENLINEAGE_URL" if os.environ.get("OPENLINEAGE_URL") else "the OPENLINEAGE__TRANSPORT variables"
    elif path is not None:
        raise LineageConfigError(f"{path}: configures no transport (transport.type); lineage would go nowhere")
    else:
        return None
    namespace = os.environ.get(NAMESPACE_VARIABLE, "").strip() or DEFAULT_NAMESPACE
    return LineageConfig(source, namespace, path)
