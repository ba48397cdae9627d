"""The `openai-batch` export: a version as OpenAI's batch output and error files, one line per
line of the job's input, in the input's order (whatever the job's input format: custom_id is
the record's id).

Both files are written beside their destination and renamed into place, so a reader never
sees a partial export; they go side by side on local disk.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.errors import BatchlineError, InputError
from batchline.registry import ENGINES
from batchline.store import ReaderStore, job_or_published, require_job
from batchline.targets.base import ExportResult, FileExport
from batchline.targets.files import atomic_write, finished, refuse_folder


@dataclass(frozen=True)
class OpenAIBatchExport:
    responses: int  # lines of the output file
    errors: int  # lines of the error file
    pending: int  # input lines in neither file: records without an outcome yet (--partial)


OPENAI_PAGE = 1000


def openai_errors_path(out: Path) -> Path:
    """Where the error file goes beside an output file: `x.jsonl` -> `x.errors.jsonl`."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.errors.jsonl")


def export_openai_batch(store: ReaderStore, version: str, out: Path, errors: Path, *,
                        partial: bool = False) -> OpenAIBatchExport:
    """OpenAI's batch output file (one response line per result) and error file (one line
    per dead letter), both in the order of the job's input, for any job: custom_id is the
    record's id. The input is streamed and results are fetched a page of ids at a time."""
    from batchline.formats.openai_batch import error_line, response_line
    from batchline.snapshot import pinned_sources
    from batchline.snapshot.order import snapshot_records
    from batchline.sources import snapshot_digest
    job = finished(store, require_job(store, version), partial)
    spec = job.spec
    # The files follow the input's order, so the input must still be the planned snapshot;
    # the scan below reads each object conditional on the pin checked here.
    sources, pins = pinned_sources(spec.input, store.url)
    if spec.version(snapshot_digest(pins), spec.base_version) != version:
        raise InputError(f"{spec.input.describe()}: the input changed since {version} "
                         "was planned; the export reads it for the order of the lines")
    local_model = _local_model_name(spec.model.engine, spec.model.path, spec.model.options)
    counts = {"responses": 0, "errors": 0, "pending": 0}

    def ids() -> Iterator[str]:
        for record in snapshot_records(spec, store.url, sources):
            yield record.id

    def write(out_tmp: Path, errors_tmp: Path, dead: _DeadLetterIndex) -> int:
        with out_tmp.open("w", encoding="utf-8") as fo, errors_tmp.open("w", encoding="utf-8") as fe:
            for page in _pages(ids(), OPENAI_PAGE):
                found = store.results_for(version, page)
                letters = dead.lookup([i for i in page if i not in found])
                for record_id in page:
                    r = found.get(record_id)
                    if r is not None:
                        line = response_line(version, record_id, r.output, r.created_at,
                                             r.model or local_model,
                                             r.input_tokens, r.output_tokens)
                        if r.carry is not None:
                            line["carry"] = r.carry
                        fo.write(json.dumps(line, ensure_ascii=False) + "\n")
                        counts["responses"] += 1
                    elif record_id in letters:
                        kind, error, carry = letters[record_id]
                        line = error_line(version, record_id, kind, error)
                        if carry is not None:
                            line["carry"] = carry
                        fe.write(json.dumps(line, ensure_ascii=False) + "\n")
                        counts["errors"] += 1
                    else:
                        counts["pending"] += 1
        if counts["pending"] and job.info.state == "sealed":
            raise BatchlineError(f"{counts['pending']:,} records of {version} have no outcome although it is "
                                 "sealed; the store does not cover the input")
        return counts["responses"]

    with tempfile.TemporaryDirectory(prefix="batchline-export-") as folder:
        dead = _DeadLetterIndex(store, version, Path(folder))
        try:
            # The error file is renamed into place just before the output file; a failure
            # before then leaves neither changed.
            atomic_write(out, lambda out_tmp: atomic_write(errors, lambda errors_tmp: write(out_tmp, errors_tmp, dead)))
        finally:
            dead.close()
    return OpenAIBatchExport(counts["responses"], counts["errors"], counts["pending"])


def _local_model_name(engine: str, path: str | None, options: Any) -> str:
    """The model a result names when the store did not record one."""
    if ENGINES[engine].remote and options.get("model"):
        return str(options["model"])
    return path or engine


def _pages(items: Iterator[str], size: int) -> Iterator[list[str]]:
    page: list[str] = []
    for item in items:
        page.append(item)
        if len(page) == size:
            yield page
            page = []
    if page:
        yield page


class _DeadLetterIndex:
    """A version's dead letters, copied to a scratch SQLite file: the export looks them
    up a page at a time in input order, and a failed job can have too many to hold."""

    _CHUNK = 500  # ids per query, under SQLite's limit on bound parameters

    def __init__(self, store: ReaderStore, version: str, folder: Path) -> None:
        self.db = sqlite3.connect(folder / "dead-letters.db")
        self.db.execute("CREATE TABLE dead (id TEXT PRIMARY KEY, kind TEXT NOT NULL, error TEXT NOT NULL, carry TEXT)")
        self.db.executemany("INSERT INTO dead VALUES (?, ?, ?, ?)",
                            ((d.record_id, d.kind, d.error, None if d.carry is None else json.dumps(d.carry))
                             for d in store.iter_dead_letters(version)))
        self.db.commit()

    def lookup(self, ids: Sequence[str]) -> dict[str, tuple[str, str, Any]]:
        out: dict[str, tuple[str, str, Any]] = {}
        for i in range(0, len(ids), self._CHUNK):
            chunk = list(ids[i:i + self._CHUNK])
            marks = ",".join("?" * len(chunk))
            for record_id, kind, error, carry in self.db.execute(
                    f"SELECT id, kind, error, carry FROM dead WHERE id IN ({marks})", chunk):
                out[record_id] = (kind, error, None if carry is None else json.loads(carry))
        return out

    def close(self) -> None:
        self.db.close()


class OpenAIBatchFiles(FileExport):
    name = "openai-batch"
    help = ("OpenAI's batch output file (--out) and error file (--errors), one line per input line, in the "
            "input's order")
    errors_file = True

    def export(self, store: ReaderStore, target: str, out: str | None, errors: str | None,
               partial: bool) -> ExportResult:
        from batchline.sources import is_remote

        if out is None:
            raise BatchlineError("--format openai-batch needs --out FILE (the error file goes beside it)")
        if is_remote(out):
            raise BatchlineError("--format openai-batch writes two files side by side on local disk; "
                                 "--out must be a local file (copy them to object storage afterwards)")
        out_path = Path(out)
        refuse_folder(str(out_path))
        errors_path = Path(errors) if errors is not None else openai_errors_path(out_path)
        refuse_folder(str(errors_path), "--errors")
        if errors_path.resolve() == out_path.resolve():
            raise BatchlineError(f"--errors {errors_path} is the output file itself; name another file")
        version = job_or_published(store, target).version
        done = export_openai_batch(store, version, out_path, errors_path, partial=partial)
        return ExportResult(version, done.responses, out_path, done.errors, errors_path, done.pending)


OPENAI_BATCH_FILES = OpenAIBatchFiles()
