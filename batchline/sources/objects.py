"""Objects in S3 (or an S3-compatible store) and Google Cloud Storage, through obstore.

An object is pinned by what the store guarantees about it: its size, its ETag
and, where the bucket keeps them, its version id (S3 with versioning) or
generation (GCS, always). A bucket listing returns no version id, so pinning
takes one HEAD per object. Every read after that is conditional on the pin:
it names the pinned version where there is one and sends `If-Match` with the
ETag, so an object overwritten or deleted after planning is refused with one
line naming its key, and never half-read.

The lake's own faults (throttling, a connection reset in the middle of a
range, a request that stalls) are retried here with exponential backoff and
full jitter; a read that cannot succeed within `unavailable_seconds` raises
SourceUnavailable, which a worker answers by giving its shard back.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NoReturn, TypeVar, cast

from batchline.errors import InputError, SourceUnavailable, missing_extra, one_line
from batchline.lake import LakeSettings, lake_settings
from batchline.sources.base import READ_METER, InputSource, KeyedFamily, LocationFamily, Pin

if TYPE_CHECKING:
    from obstore.store import GCSStore, S3Store

    from batchline.spec.reader import Fields, ParseContext, SpecReader

    ObjectStore = S3Store | GCSStore

SCHEMES = ("s3", "gs")
GLOB_CHARS = "*?["
LIST_PAGE = 1000  # keys per listing page (S3's and GCS's own maximum)
TAIL_BYTES = 64 * 1024  # what a Parquet reader's first look at the footer fetches
STREAM_CHUNK = 1 << 20
_BACKOFF_FIRST = 0.1
_BACKOFF_MAX = 10.0
_STATUS = re.compile(r"status code: (\d{3})")

log = logging.getLogger("batchline.lake")
T = TypeVar("T")


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of `s3://bucket/key` or `gs://bucket/key`."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in SCHEMES or not bucket:
        raise InputError(f"{url}: not an object URL (s3://bucket/key or gs://bucket/key)")
    return scheme, bucket, key


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise InputError(missing_extra("s3:// and gs:// objects", "obstore", "lake")) from None
    return obstore


@functools.lru_cache(maxsize=64)
def object_store(scheme: str, bucket: str, settings: LakeSettings) -> ObjectStore:
    """One client per bucket and settings, shared by every source of the process."""
    _obstore()
    from obstore.store import GCSStore, S3Store

    kwargs = settings.obstore_kwargs(scheme)
    if scheme == "s3":
        return S3Store(bucket, **kwargs)
    return GCSStore(bucket, **kwargs)


# --- errors and retries -----------------------------------------------------------


def _status(exc: BaseException) -> int | None:
    match = _STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def transient(exc: BaseException) -> bool:
    """Throttling (S3 503 SlowDown, GCS 429), a server error, a reset connection or a
    timeout: worth trying again. Anything the store answered with another 4xx is not."""
    from obstore.exceptions import GenericError

    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    if not isinstance(exc, GenericError):
        return False
    status = _status(exc)
    return status is None or status >= 500 or status in (408, 429)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def refuse(url: str, pin: Pin | None, exc: BaseException) -> NoReturn:
    """An error the store answered for good, as one line naming the object."""
    from obstore.exceptions import PermissionDeniedError, PreconditionError, UnauthenticatedError

    if isinstance(exc, PreconditionError) and pin is not None:
        raise InputError(f"input changed since planning: {url} (its ETag is no longer {pin.etag}); "
                         "plan again to use the new content") from None
    if isinstance(exc, FileNotFoundError):
        if pin is not None:
            gone = f"version {pin.version} is gone" if pin.version else "it is gone"
            raise InputError(f"input changed since planning: {url} ({gone})") from None
        raise InputError(f"{url}: no such object") from None
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        raise InputError(f"{url}: access refused ({first_line(exc)}); give this machine read access "
                         "(batchline grants prints the policy)") from None
    raise InputError(f"{url}: cannot read input: {first_line(exc)}") from None


def retrying(what: str, settings: LakeSettings, op: Callable[[], T], pin: Pin | None = None) -> T:
    """`op()`, retried with backoff and full jitter while the store's faults are
    transient, for at most `settings.unavailable_seconds`."""
    deadline = time.monotonic() + settings.unavailable_seconds
    tries = 0
    while True:
        try:
            return op()
        except (InputError, SourceUnavailable, ConditionFailed):
            raise
        except Exception as exc:
            if not transient(exc):
                refuse(what, pin, exc)
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise SourceUnavailable(
                    f"{what}: the object store did not answer for {settings.unavailable_seconds:g}s "
                    f"({tries} tries; last: {first_line(exc)})") from None
            delay = min(left, random.uniform(0, min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** tries)))
            log.warning("%s: %s; retrying in %.2fs (try %d)", what, first_line(exc), delay, tries)
            time.sleep(delay)


# --- one object -------------------------------------------------------------------


class ObjectSource:
    """One object, read conditional on its pin (taken by `pin()` at planning, or
    handed in from a shard's slice)."""

    def __init__(self, location: str, settings: LakeSettings, pin: Pin | None = None) -> None:
        self.location = location
        self.scheme, self.bucket, self.key = split_url(location)
        self.settings = settings
        self._pin = pin
        self._tail: tuple[int, bytes] | None = None  # the footer region, kept for a second open

    def __str__(self) -> str:
        return self.location

    @property
    def store(self) -> ObjectStore:
        return object_store(self.scheme, self.bucket, self.settings)

    def pin(self) -> Pin:
        obs = _obstore()
        meta = retrying(self.location, self.settings, lambda: obs.head(self.store, self.key))
        self._pin = Pin(PurePosixPath(self.key).name, int(meta["size"]), etag=meta["e_tag"],
                        version=meta["version"])
        return self._pin

    def pinned(self) -> Pin:
        return self._pin if self._pin is not None else self.pin()

    def still(self, pin: Pin) -> bool:
        # Every read was conditional on the pin, so what was read is what the pin names.
        return pin == self._pin

    def slice_pin(self) -> Pin | None:
        return self.pinned()

    def get_options(self, byte_range: Any | None) -> dict[str, Any]:
        pin = self.pinned()
        options: dict[str, Any] = {}
        if byte_range is not None:
            options["range"] = byte_range
        if pin.etag:
            options["if_match"] = pin.etag
        if pin.version:
            options["version"] = pin.version
        return options

    def read(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        obs = _obstore()
        pin = self.pinned()
        if end > pin.size:
            raise InputError(f"input changed since planning: {self.location} is shorter than byte {end}")
        options = self.get_options((start, end))
        data = retrying(self.location, self.settings,
                        lambda: bytes(obs.get(self.store, self.key, options=options).bytes()), pin)
        READ_METER.add(len(data))
        if len(data) != end - start:
            raise InputError(f"input changed since planning: {self.location} (bytes {start}-{end} came back "
                             f"{len(data)} long)")
        return data

    def stream(self) -> BinaryIO:
        return cast(BinaryIO, io.BufferedReader(_ObjectStream(self), buffer_size=STREAM_CHUNK))

    def random_access(self) -> BinaryIO:
        return cast(BinaryIO, _ObjectFile(self))

    def tail_start(self) -> int | None:
        return self._tail[0] if self._tail is not None else None

    def cached_tail(self, start: int, end: int) -> bytes | None:
        if self._tail is not None and self._tail[0] <= start and end <= self._tail[0] + len(self._tail[1]):
            offset = start - self._tail[0]
            return self._tail[1][offset:offset + end - start]
        return None

    def read_tail(self, start: int) -> tuple[int, bytes]:
        """The last bytes of the object from at most `start` (a footer), once per source."""
        size = self.pinned().size
        begin = min(start, max(0, size - TAIL_BYTES))
        if self._tail is None or self._tail[0] > begin:
            self._tail = (begin, self.read(begin, size))
        return self._tail


class _ObjectStream(io.RawIOBase):
    """The object front to back in one GET; a connection lost mid-way resumes from the
    byte it stopped at (a ranged GET, conditional on the pin like the first)."""

    def __init__(self, source: ObjectSource) -> None:
        self.source = source
        self.pos = 0
        self.size = source.pinned().size
        self.chunks: Iterator[Any] | None = None
        self.buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self.buf:
            if self.pos >= self.size:
                return 0
            self.buf = memoryview(retrying(self.source.location, self.source.settings, self._next,
                                           self.source.pinned()))
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        self.pos += n
        return n

    def _next(self) -> bytes:
        obs = _obstore()
        if self.chunks is None:
            options = self.source.get_options({"offset": self.pos} if self.pos else None)
            self.chunks = iter(obs.get(self.source.store, self.source.key, options=options)
                               .stream(min_chunk_size=STREAM_CHUNK))
        try:
            chunk = bytes(next(self.chunks))
            READ_METER.add(len(chunk))
        except StopIteration:
            raise InputError(f"input changed since planning: {self.source.location} ended at byte "
                             f"{self.pos} of {self.size}") from None
        except BaseException:
            self.chunks = None  # the next try starts a new request where this one stopped
            raise
        return chunk


class _ObjectFile(io.RawIOBase):
    """A seekable view of the object for Parquet: the footer is fetched once (the last
    64 KiB, more if the metadata is longer), each row group's column chunks in one ranged
    GET (`prefetch`), and anything else exactly as asked, each conditional on the pin."""

    def __init__(self, source: ObjectSource) -> None:
        self.source = source
        self.size = source.pinned().size
        self.pos = 0
        self._span: tuple[int, bytes] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def prefetch(self, start: int, end: int) -> None:
        end = min(end, self.size)
        if end <= start:
            return
        # What the footer fetch already holds (the end of the last row group, or all of
        # a small file) is not fetched again.
        tail_start = self.source.tail_start()
        cut = max(start, min(end, tail_start if tail_start is not None else end))
        head = self.source.read(start, cut) if cut > start else b""
        rest = self.source.cached_tail(cut, end) if cut < end else b""
        assert rest is not None
        self._span = (start, head + rest)

    def _bytes(self, start: int, end: int) -> bytes:
        if self._span is not None and self._span[0] <= start and end <= self._span[0] + len(self._span[1]):
            offset = start - self._span[0]
            return self._span[1][offset:offset + end - start]
        cached = self.source.cached_tail(start, end)
        if cached is not None:
            return cached
        if end > self.size - TAIL_BYTES:
            begin, tail = self.source.read_tail(start)
            return tail[start - begin:end - begin]
        return self.source.read(start, end)

    def read(self, size: int | None = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        data = self._bytes(self.pos, end)
        self.pos = end
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


# --- many objects: globs and manifests ----------------------------------------------


def has_glob(text: str) -> bool:
    return any(ch in text for ch in GLOB_CHARS)


def _matches(parts: Sequence[str], pattern: Sequence[str]) -> bool:
    """A key's path segments against a glob's: `*`, `?` and `[...]` stay within a
    segment, as for files; `**` spans any number of them."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatchcase(parts[0], pattern[0]) and _matches(parts[1:], pattern[1:])


def expand_glob(url: str, settings: LakeSettings) -> list[str]:
    """The objects a glob names, sorted: one prefix listing (a page per 1,000 keys) up to
    the last `/` before the first wildcard, filtered segment by segment."""
    obs = _obstore()
    scheme, bucket, pattern = split_url(url)
    cut = min(pattern.index(ch) for ch in GLOB_CHARS if ch in pattern)
    prefix = pattern[:cut].rpartition("/")[0]
    store = object_store(scheme, bucket, settings)
    wanted = pattern.split("/")
    keys: list[str] = []
    last: list[str | None] = [None]

    def page_through() -> None:
        # Resumes after the last key seen when a page fails part-way.
        for page in obs.list(store, prefix or None, offset=last[0], chunk_size=LIST_PAGE):
            for meta in page:
                key = meta["path"]
                last[0] = key
                if not key.endswith("/") and _matches(key.split("/"), wanted):
                    keys.append(key)

    retrying(url, settings, page_through)
    return [f"{scheme}://{bucket}/{key}" for key in sorted(set(keys))]


def list_prefix(url: str, settings: LakeSettings) -> list[str]:
    """Every object under a prefix URL (ending in `/`), sorted."""
    obs = _obstore()
    scheme, bucket, prefix = split_url(url)
    store = object_store(scheme, bucket, settings)

    def listing() -> list[str]:
        return sorted(meta["path"] for page in obs.list(store, prefix.rstrip("/") or None, chunk_size=LIST_PAGE)
                      for meta in page if not meta["path"].endswith("/"))

    return [f"{scheme}://{bucket}/{key}" for key in retrying(url, settings, listing)]


def read_object(url: str, settings: LakeSettings) -> bytes:
    """A small object whole (a manifest)."""
    obs = _obstore()
    scheme, bucket, key = split_url(url)
    store = object_store(scheme, bucket, settings)
    return retrying(url, settings, lambda: bytes(obs.get(store, key).bytes()))


# --- writing (exports) --------------------------------------------------------------------


class ConditionFailed(Exception):
    """A conditional put found the object other than expected."""


def _at(url: str, settings: LakeSettings) -> tuple[ObjectStore, str]:
    scheme, bucket, key = split_url(url)
    return object_store(scheme, bucket, settings), key


def object_exists(url: str, settings: LakeSettings) -> bool:
    obs = _obstore()
    store, key = _at(url, settings)

    def head() -> bool:
        try:
            obs.head(store, key)
        except FileNotFoundError:
            return False
        return True

    return retrying(url, settings, head)


def read_versioned(url: str, settings: LakeSettings) -> tuple[bytes, dict[str, Any]] | None:
    """A small object and its ETag and version (what a conditional put of it names), or None."""
    obs = _obstore()
    store, key = _at(url, settings)

    def get() -> tuple[bytes, dict[str, Any]] | None:
        try:
            result = obs.get(store, key)
        except FileNotFoundError:
            return None
        meta = result.meta
        return bytes(result.bytes()), {"e_tag": meta["e_tag"], "version": meta["version"]}

    return retrying(url, settings, get)


def upload(path: Path, url: str, settings: LakeSettings) -> None:
    """A local file to an object, whole: multipart for a large one, visible only once complete."""
    obs = _obstore()
    store, key = _at(url, settings)
    retrying(url, settings, lambda: obs.put(store, key, path))


def put_if(url: str, data: bytes, settings: LakeSettings, expected: dict[str, Any] | None) -> None:
    """Writes `data` only if the object is still what `expected` (from `read_versioned`)
    describes, or is still absent when `expected` is None: If-Match or If-None-Match."""
    obs = _obstore()
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    store, key = _at(url, settings)
    mode: Any = "create" if expected is None else {k: v for k, v in expected.items() if v is not None}

    def put() -> None:
        try:
            obs.put(store, key, data, mode=mode)
        except (AlreadyExistsError, PreconditionError):
            raise ConditionFailed(url) from None

    retrying(url, settings, put)


def delete_object(url: str, settings: LakeSettings) -> None:
    obs = _obstore()
    store, key = _at(url, settings)
    retrying(url, settings, lambda: obs.delete(store, key))


def delete_prefix(url: str, settings: LakeSettings) -> None:
    obs = _obstore()
    keys = [split_url(k)[2] for k in list_prefix(url, settings)]
    if keys:
        store, _prefix = _at(url, settings)
        retrying(url, settings, lambda: obs.delete(store, keys))


# --- the family ---------------------------------------------------------------------------


class Objects(LocationFamily, KeyedFamily):
    """Objects in S3 and GCS: `input.path` URLs (a glob is one prefix listing) and
    `input.manifest`, a file or object listing objects one a line."""

    name = "objects"
    schemes = ("s3://", "gs://")
    keys: ClassVar[Fields] = {"manifest": {"type": "string", "minLength": 1,
                         "description": "A file or object listing the input's objects, one a line"}}

    def expand(self, location: str, where: str, r: SpecReader, ctx: ParseContext) -> list[str]:
        """An object URL as it is, or a glob's matches from one prefix listing."""
        _scheme, _bucket, key = split_url(location)
        if not key or key.endswith("/"):
            r.fail("input.path", f"{location} names a bucket or a folder, not an object; add a glob such as "
                                 f"{location.rstrip('/')}/*.jsonl")
        if not has_glob(key):
            return [location]
        matches = expand_glob(location, lake_settings(ctx.storage))
        if not matches:
            r.fail("input.path", f"{location!r} matches no object")
        return matches

    def open(self, location: str, storage: Mapping[str, Any] | None = None, pin: Pin | None = None) -> ObjectSource:
        return ObjectSource(location, lake_settings(storage), pin)

    def upload(self, path: Path, location: str, storage: Mapping[str, Any] | None = None) -> None:
        upload(path, location, lake_settings(storage))

    def listing(self, prefix: str, storage: Mapping[str, Any] | None = None) -> list[tuple[str, float]]:
        settings = lake_settings(storage)
        obs = _obstore()
        scheme, bucket, key = split_url(prefix)
        store = object_store(scheme, bucket, settings)

        def listed() -> list[tuple[str, float]]:
            return sorted((f"{scheme}://{bucket}/{meta['path']}", meta["last_modified"].timestamp())
                          for page in obs.list(store, key.rstrip("/") + "/", chunk_size=LIST_PAGE)
                          for meta in page if not meta["path"].endswith("/"))

        return retrying(prefix, settings, listed)

    def delete(self, location: str, storage: Mapping[str, Any] | None = None) -> None:
        settings = lake_settings(storage)
        obs = _obstore()
        store, key = _at(location, settings)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                obs.delete(store, key)

        retrying(location, settings, remove)

    def download(self, location: str, dest: Path, storage: Mapping[str, Any] | None = None) -> Path:
        settings = lake_settings(storage)
        keys = list_prefix(location, settings) if location.endswith("/") else [location]
        if not keys:
            raise InputError(f"{location}: no object under this prefix")
        for key_url in keys:
            out = dest / key_url[len(location):] if location.endswith("/") else dest
            out.parent.mkdir(parents=True, exist_ok=True)
            with ObjectSource(key_url, settings).stream() as src, out.open("wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
        return dest

    def parse(self, key: str, section: Mapping[str, Any], r: SpecReader, ctx: ParseContext) -> InputSource:
        from batchline.sources import FileSet

        manifest = r.string(section[key], "input.manifest")
        if ctx.resolved:  # a stored spec names its objects under `path`
            r.fail("input.manifest", "a planned job's spec lists its objects under input.path")
        return FileSet(self._manifest(r, manifest, ctx))

    def _manifest(self, r: SpecReader, manifest: str, ctx: ParseContext) -> tuple[str, ...]:
        """The objects a manifest lists, one a line: an object URL, or (in a manifest that is
        itself an object) a key in the manifest's bucket. Blank lines and `#` comments are skipped."""
        bucket_url = None
        if manifest.startswith(self.schemes):
            scheme, bucket, _key = split_url(manifest)
            bucket_url = f"{scheme}://{bucket}/"
            data = read_object(manifest, lake_settings(ctx.storage))
        else:
            path = (ctx.base_dir / manifest).resolve()
            manifest = str(path)
            try:
                data = path.read_bytes()
            except OSError as exc:
                r.fail("input.manifest", f"cannot read {path}: {one_line(exc.strerror or exc)}")
        try:
            lines = data.decode("utf-8-sig").splitlines()
        except UnicodeDecodeError:
            r.fail("input.manifest", f"{manifest} is not UTF-8 text")
        seen: dict[str, int] = {}
        for line_no, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if not line.startswith(self.schemes):
                if bucket_url is None:
                    r.fail("input.manifest", f"{manifest}:{line_no}: {line!r} is not an object URL (s3://bucket/key "
                                             "or gs://bucket/key); a key alone needs a manifest in the same bucket")
                line = bucket_url + line.lstrip("/")
            if line in seen:
                r.fail("input.manifest", f"{manifest}:{line_no}: {line} is listed again (first at line {seen[line]})")
            seen[line] = line_no
        if not seen:
            r.fail("input.manifest", f"{manifest} lists no object")
        return tuple(seen)

    def location_access(self, locations: Sequence[str], what: str) -> list[str]:
        """One read-only policy per bucket, over the prefix its objects share."""
        buckets: dict[tuple[str, str], list[str]] = {}
        for location in locations:
            scheme, bucket, key = split_url(location)
            buckets.setdefault((scheme, bucket), []).append(key)
        return [_bucket_access(scheme, bucket, what, keys) for (scheme, bucket), keys in buckets.items()]

    def pod_refusal(self, section: Mapping[str, Any], where: str) -> str | None:
        manifest = section.get("manifest")
        if manifest is not None and not str(manifest).startswith(self.schemes):
            return f"input.manifest: {manifest} is on this machine; give a manifest in object storage"
        return None


def _bucket_access(scheme: str, bucket: str, what: str, names: list[str]) -> str:
    if len(names) == 1 and not names[0].endswith("/"):
        pattern = names[0]  # one object, exactly
    else:
        # A folder of weights, or many objects: the whole folders they share.
        shared: list[str] = []
        for segments in zip(*(n.split("/")[:-1] for n in names), strict=False):
            if len(set(segments)) > 1:
                break
            shared.append(segments[0])
        pattern = "".join(f"{s}/" for s in shared) + "*"
    prefix = pattern.removesuffix("*")
    count = "a folder of objects" if names[0].endswith("/") else (
        f"{len(names)} object{'s' if len(names) != 1 else ''}")
    head = f"{what}, {count} at {scheme}://{bucket}/{pattern}: the database cannot guard it;"
    if scheme == "s3":
        # Reads name the pinned version, which takes s3:GetObjectVersion besides s3:GetObject;
        # a model that is a folder is listed to be fetched.
        statements: list[dict[str, Any]] = [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
                                              "Resource": [f"arn:aws:s3:::{bucket}/{pattern}"]}]
        if any(k.endswith("/") for k in names):
            statements.append({"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{bucket}"],
                               "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}}})
        policy = {"Version": "2012-10-17", "Statement": statements}
        return f"{head} give the worker's IAM role read-only access, e.g. {json.dumps(policy, separators=(',', ':'))}"
    name = f"projects/_/buckets/{bucket}/objects/{prefix}"
    condition = f'resource.name == "{name}"' if pattern == prefix else f'resource.name.startsWith("{name}")'
    return (f"{head} give the worker's service account roles/storage.objectViewer on gs://{bucket} with the IAM "
            f"condition {condition}")


OBJECTS = Objects()
