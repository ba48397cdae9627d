"""`BatchlineHook`: the store (and each launcher's options) from a `batchline` connection.

The store's credentials live in the connection (Airflow's secrets backend, its UI, an
`AIRFLOW_CONN_*` variable), never in the DAG file: the connection's host, port, login,
password and schema make a PostgreSQL URL; or its extra's `store` names a store that has no
credentials (a SQLite file, for one-machine deployments). The extra's other keys are the
launchers' options by launcher (`{"kubernetes": {"namespace": "batch"}}`); any other key is
refused, so a typo is an error, not a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import quote

from airflow.sdk import BaseHook

from batchline.errors import BatchlineError

STORE_KEY = "store"


class BatchlineHook(BaseHook):
    """A batchline store and launchers' options, from a connection of type `batchline`."""

    conn_name_attr = "batchline_conn_id"
    default_conn_name = "batchline_default"
    conn_type = "batchline"
    hook_name = "batchline"
    launcher_keys: ClassVar[tuple[str, ...]] = ("local", "kubernetes", "ray")

    def __init__(self, batchline_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.batchline_conn_id = batchline_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {"hidden_fields": [], "relabeling": {"host": "PostgreSQL host", "schema": "Database"},
                "placeholders": {"extra": '{"store": "sqlite:////var/lib/batchline/store.db (no host then)", '
                                          '"kubernetes": {"namespace": "batch"}}'}}

    def _connection(self) -> Any:
        return self.get_connection(self.batchline_conn_id)

    def _extra(self, conn: Any) -> Mapping[str, Any]:
        extra = conn.extra_dejson or {}
        known = (STORE_KEY, *self.launcher_keys)
        for key in extra:
            if key not in known:
                raise BatchlineError(f"connection {self.batchline_conn_id}: extra key {key!r} is not one of "
                                     f"{', '.join(known)}")
        return extra

    def store_url(self) -> str:
        """The store's URL, credentials included: never logged, never passed on a command line."""
        conn = self._connection()
        extra = self._extra(conn)
        given = extra.get(STORE_KEY)
        if given is not None:
            if not isinstance(given, str) or not given.startswith("sqlite:"):
                raise BatchlineError(f"connection {self.batchline_conn_id}: extra 'store' names a SQLite store "
                                     f"(sqlite:///PATH); a PostgreSQL store is the connection's host and login")
            if conn.host or conn.login or conn.password:
                raise BatchlineError(f"connection {self.batchline_conn_id}: give either extra 'store' or a host, "
                                     f"not both")
            return given
        if not conn.host:
            raise BatchlineError(f"connection {self.batchline_conn_id}: no host (a PostgreSQL store) and no extra "
                                 f"'store' (a SQLite one)")
        user = quote(conn.login or "", safe="")
        password = f":{quote(conn.password, safe='')}" if conn.password else ""
        auth = f"{user}{password}@" if user else ""
        port = f":{conn.port}" if conn.port else ""
        return f"postgresql://{auth}{conn.host}{port}/{quote(conn.schema or 'postgres', safe='')}"

    def launcher_options(self, launcher: str) -> dict[str, Any]:
        """The options the connection gives `launcher` (its extra's section of that name)."""
        section = self._extra(self._connection()).get(launcher) or {}
        if not isinstance(section, dict):
            raise BatchlineError(f"connection {self.batchline_conn_id}: extra {launcher!r} must be a mapping of "
                                 f"the launcher's options")
        return dict(section)
