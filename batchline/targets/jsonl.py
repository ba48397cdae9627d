"""The `jsonl` export: one JSON object a line for each result of a version (its id, output,
ACL and model, and with them what the job carries), to a file, an object or standard output."""

from __future__ import annotations

from typing import ClassVar

from batchline.store import ReaderStore, job_or_published
from batchline.targets.base import ExportResult, FileExport
from batchline.targets.files import export_to, finished, local_or_url, write_jsonl


class JsonlFile(FileExport):
    name: ClassVar[str] = "jsonl"
    help: ClassVar[str] = "one JSON object a line (to standard output without --out)"

    def export(self, store: ReaderStore, target: str, out: str | None, errors: str | None,
               partial: bool) -> ExportResult:
        job = finished(store, job_or_published(store, target), partial)
        if out is None:
            return ExportResult(job.version, write_jsonl(store, job, None), None)
        return ExportResult(job.version, export_to(out, lambda p: write_jsonl(store, job, p)), local_or_url(out))


JSONL_FILE = JsonlFile()
