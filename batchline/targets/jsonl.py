"""The `jsonl` export: one JSON object a line for each result of a version (its id, output,
ACL and model, and with them what the job carries), to a file, an object or standard output."""

from __future__ import annotations

from typing import ClassVar

from batchline.store import ReaderStore, job_or_published
from batchline.targets.base import ExportResult, FileExport
from batchline.targets.files import export_jsonl, export_to, finished, local_or_url


class JsonlFile(FileExport):
    name: ClassVar[str] = "jsonl"
    help: ClassVar[str] = "one JSON object a line (to standard output without --out)"

    def export(self, store: ReaderStore, target: str, out: str | None, errors: str | None,
               partial: bool) -> ExportResult:
        version = job_or_published(store, target).version
        finished(store, version, partial)
        if out is None:
            return ExportResult(version, export_jsonl(store, version, None), None)
        return ExportResult(version, export_to(out, lambda p: export_jsonl(store, version, p)), local_or_url(out))


JSONL_FILE = JsonlFile()
