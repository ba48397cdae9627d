"""A version's outcomes a shard at a time: what a publication target lays out as one file per
shard, and what a worker writes of the shard it completes (`output.*.files: per-shard`).

A shard's *identity* is a digest of the input its records were read from (the digests of the
pieces it holds, else its slice's digest): two versions whose shards read the same bytes (or,
for Parquet and records the store holds, the same ids and content hashes) have shards of one
identity, whatever file or object the input was. A shard whose every outcome was carried
from the base version, of an identity the base version had too, holds exactly the rows the
base's shard held: a target may share the base's file for it instead of writing it again.

Mixed into `StoreCore`; the SQL is each backend's (the same statement names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchline.store.base import StoreBase, stored_dead_letter, stored_result


@dataclass(frozen=True)
class ShardUnit:
    """One shard of a version, as a target lays its rows out."""

    shard_no: int
    identity: str
    records: int
    carried: int  # results carried from the base version
    results: int  # every result, carried ones included
    dead_letters: int
    files: Mapping[str, Any] | None = None  # what its completing worker wrote, by target key
    epoch: int = 0  # the lease epoch that completed it: its file's name holds it
    ran_in: str | None = None  # the region of the worker whose claim it was: its file's staging prefix

    @property
    def all_carried(self) -> bool:
        """Every outcome of it is a result carried from the base version: its rows are the base's."""
        return self.records > 0 and self.carried == self.records


def unit_identity(version: str, shard_no: int, slice_: Mapping[str, Any], first_piece: int | None,
                  end_piece: int | None) -> str:
    """The digest of what the shard read; a shard whose slice says no digest is its own alone."""
    pieces = slice_.get("pieces") or []
    if pieces and first_piece is not None and end_piece is not None:
        material = "\n".join(str(p["digest"]) for p in pieces if first_piece <= int(p["no"]) < end_piece)
    elif slice_.get("digest"):
        material = str(slice_["digest"])
    else:
        material = f"unshared\0{version}\0{shard_no}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ShardColumns:
    """A shard's outcomes computed in its version (what its worker's file holds), a column each,
    as the store keeps them (an ACL as its JSON text): read without making an object a row, for a
    check that compares a million rows with a file's."""

    ids: list[str]
    outputs: list[str]
    acls: list[str | None]
    labels: list[str | None]
    models: list[str | None]
    attempts: list[int]
    input_tokens: list[int | None]
    output_tokens: list[int | None]
    created_at: list[float]
    dead_ids: list[str]
    dead_kinds: list[str]
    dead_errors: list[str | None]
    dead_acls: list[str | None]
    dead_attempts: list[int]
    dead_created_at: list[float]


def _columns(rows: list[Any], width: int) -> list[list[Any]]:
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]


class ShardOutcomes(StoreBase):
    """Each shard's outcomes as a target lays its rows out (`files: per-shard`)."""

    def shard_units(self, version: str) -> list[ShardUnit]:
        """The version's shards, in order, each with its identity and what its outcomes are."""
        rows = self._read(lambda tx: tx.all(self.q.SHARD_UNITS, {"v": version}))
        return [ShardUnit(int(r[0]), unit_identity(version, int(r[0]), self._unjson(r[1]), r[2], r[3]), int(r[4]),
                          int(r[5] or 0),
                          int(r[6] or 0), int(r[7] or 0), self._unjson(r[8]) if r[8] is not None else None, int(r[9] or 0),
                          r[10])
                for r in rows]

    def shard_outcomes(self, version: str, shard_no: int, *, computed_only: bool = False) -> tuple[list[Any], list[Any]]:
        """The shard's results (only those computed in this version, with `computed_only`: what
        its worker may read) and dead letters, each in id order."""
        results_stmt = self._carrying(version, "COMPUTED_RESULTS_OF_SHARD" if computed_only else "RESULTS_OF_SHARD")
        dead_stmt = self._carrying(version, "DEAD_LETTERS_OF_SHARD")
        params = {"v": version, "s": shard_no}

        def body(tx: Any) -> tuple[list[Any], list[Any]]:
            return ([stored_result(r) for r in tx.all(results_stmt, params)],
                    [stored_dead_letter(r) for r in tx.all(dead_stmt, params)])

        result: tuple[list[Any], list[Any]] = self._read(body, snapshot=True)
        return result

    def shard_columns(self, version: str, shard_no: int) -> ShardColumns:
        """The outcomes the shard's worker computed, column by column (`ShardColumns`), in id order."""
        params = {"v": version, "s": shard_no}

        def body(tx: Any) -> tuple[list[Any], list[Any]]:
            pieces = tx.one(self.q.SHARD_PIECES, params)
            first, end = (pieces[0], pieces[1]) if pieces is not None and pieces[0] is not None else (None, None)
            return (tx.all(self.q.SHARD_COLUMNS, {**params, "first": first, "end": end}),
                    tx.all(self.q.DEAD_LETTERS_OF_SHARD, params))

        results, dead = self._read(body, snapshot=True)
        r = _columns(results, 9)  # SHARD_COLUMNS' columns
        d = _columns(dead, 8)  # as stored_dead_letter reads them
        return ShardColumns(ids=r[0], outputs=r[1], acls=r[2], labels=r[3], models=r[4], attempts=r[5],
                            input_tokens=r[6], output_tokens=r[7], created_at=r[8], dead_ids=d[0],
                            dead_kinds=d[2], dead_errors=d[3], dead_acls=d[4], dead_attempts=d[5],
                            dead_created_at=d[7])
