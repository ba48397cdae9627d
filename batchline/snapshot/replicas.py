"""Replicas of a version's input: checked equal to the primary, and read in its place.

A replica (`input.replicas.REGION`, or `batchline replicas add`) holds the primary's objects
under the same keys below another prefix: an object's key below the primary's root (the
longest folder its objects share) is kept below the replica's prefix. Before a worker reads
one, each of its objects is checked against the primary's pin: the same size, and the same
content, compared by the object stores' own checksum where both keep one that is a digest of
the bytes (a single-part object's MD5 ETag, on S3 and S3-compatible stores), else by the
SHA-256 of both objects' bytes, each read conditional on its pin. The replica's own pins (its
ETags and version ids) are kept per version and region in the store, and every read of the
replica is conditional on them, its slices checked against their digests as the primary's
are. A replica that differs is refused by name and nothing is recorded.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from batchline.errors import InputError
from batchline.snapshot.reading import Slice
from batchline.sources import Pin, open_source
from batchline.spec import JobSpec
from batchline.store.ports import Replicas
from batchline.store.replicas import ReplicaRecord

# A single-part object's ETag is the MD5 of its bytes (S3 without SSE-KMS, MinIO, moto); a
# multipart one ends in "-N", and others are opaque: only the first kind compares content.
_MD5_ETAG = re.compile(r'"?([0-9a-fA-F]{32})"?')
_CHUNK = 1 << 20


def common_root(locations: Sequence[str]) -> str:
    """The longest folder (`scheme://bucket/.../`) every location is under."""
    folders = [loc[:loc.rindex("/") + 1] for loc in locations]
    root = folders[0]
    for folder in folders[1:]:
        while not folder.startswith(root):
            root = root[:root.rstrip("/").rindex("/") + 1]
    return root


def _digest(url: str, storage: Mapping[str, Any], pin: Pin) -> str:
    h = hashlib.sha256()
    with open_source(url, storage, pin).stream() as stream:
        while chunk := stream.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _md5(pin: Pin) -> str | None:
    match = _MD5_ETAG.fullmatch(pin.etag or "")
    return match.group(1).lower() if match else None


def check_replica(spec: JobSpec, region: str, location: str, storage: Mapping[str, Any],
                  by: str) -> ReplicaRecord:
    """`location` checked object by object against the version's pinned input (its stored spec's
    `pins`); the replica's record, or InputError naming the first object that differs."""
    if not spec.pins:
        raise InputError(f"replica {region}: this version's input is not a list of objects it pinned one by one "
                         "(a table's snapshot, or rows): nothing to replicate")
    if not location.startswith(("s3://", "gs://")) or not location.endswith("/"):
        raise InputError(f"replica {region}: {location!r} must be an s3:// or gs:// prefix ending in '/'")
    primaries = [str(p["location"]) for p in spec.pins]
    if not all(p.startswith(("s3://", "gs://")) for p in primaries):
        raise InputError(f"replica {region}: the version's input is not in object storage ({primaries[0]})")
    root = common_root(primaries)
    if location == root:
        raise InputError(f"replica {region}: {location} is the primary itself")
    pins: dict[str, dict[str, Any]] = {}
    by_md5 = by_bytes = 0
    for stored in spec.pins:
        primary = str(stored["location"])
        primary_pin = Pin.from_json(dict(stored))
        copy = location + primary[len(root):]
        copy_pin = open_source(copy, storage).pin()
        if copy_pin.size != primary_pin.size:
            raise InputError(f"replica {region}: {copy} is {copy_pin.size:,} bytes and {primary} "
                             f"{primary_pin.size:,}: not a copy; nothing was recorded")
        md5s = _md5(primary_pin), _md5(copy_pin)
        if md5s[0] is not None and md5s[0] == md5s[1]:
            by_md5 += 1
        elif _digest(primary, spec.input.storage_of(primary), primary_pin) == _digest(copy, storage, copy_pin):
            by_bytes += 1
        else:
            raise InputError(f"replica {region}: {copy} differs from {primary} (same size, other bytes: SHA-256 "
                             "compared); nothing was recorded")
        pins[primary] = copy_pin.to_json()
    compared = "; ".join(part for part in (
        f"{by_md5} by size and MD5 ETag" if by_md5 else "",
        f"{by_bytes} by size and the SHA-256 of both objects' bytes" if by_bytes else "") if part)
    return ReplicaRecord(region, location, root, pins, f"{len(pins)} objects: {compared}", by, time.time())


def replica_slice(sl: Slice, replica: ReplicaRecord, storage: Mapping[str, Any]) -> Slice:
    """The slice as the replica holds it: its object and that object's own pin, with the
    slice's digests unchanged (they are checked on what the replica returns)."""
    pin = replica.pins.get(sl.path)
    if pin is None:
        raise InputError(f"replica {replica.region} holds no checked copy of {sl.path}")
    return replace(sl, path=replica.location_of(sl.path), pin=Pin.from_json(pin), storage=storage)


def check_replicas(spec: JobSpec, wanted: Mapping[str, tuple[str, Mapping[str, Any]]],
                   recorded: Mapping[str, ReplicaRecord], by: str) -> list[ReplicaRecord]:
    """Each replica of `wanted` (region -> location, storage) not `recorded` at that location
    yet, checked against the version's pinned input; the first that differs stops them all."""
    return [check_replica(spec, region, location, {**spec.input.storage, **storage}, by)
            for region, (location, storage) in wanted.items()
            if not (region in recorded and recorded[region].location == location)]


def record_replicas(store: Replicas, version: str, replicas: Sequence[ReplicaRecord],
                    log: Callable[[str], None]) -> None:
    """Checked replicas recorded for the version's workers, each said."""
    for replica in replicas:
        store.add_replica(version, replica)
        log(f"replica {replica.region}: {replica.location} checked against the primary ({replica.compared}) "
            "and recorded")


def spec_replicas(spec: JobSpec) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """The replicas a spec names (`input.replicas`), as `check_replicas` takes them."""
    return {region: (r.location, r.storage) for region, r in spec.input.regions.replicas.items()}
