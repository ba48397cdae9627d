"""Access rules: a record's ACL, a caller's groups, and the one rule that compares them (I6).

Two types, each made in one place and carried as it is everywhere after:

- `Acl`, a record's ACL: the groups that may read the record, exactly as written. It is
  made when the record is read (`Acl.read`, whatever format the record came in; a format
  whose cells hold groups in text, such as CSV, splits the cell by its own rule first),
  and goes through the store (`to_json` and `from_json`, the one text form the store
  keeps), the exports, the Iceberg and Lance columns (`to_list`) and a record's content
  hash (`to_json` again, so every pinned version hash stays what it was).
- `Groups`, a caller's groups: made only by `caller_groups`, which refuses what cannot be
  a group; the search prefilter of an index and every check below take a `Groups`, never
  a list, so nothing downstream checks the caller again, or differently.

A caller's group matches an ACL entry only when the two strings are equal: nothing is
stripped, case-folded or Unicode-normalised, here or anywhere else. Every comparison of a
caller's groups with an ACL goes through `admits` (in Python) or is given the `Groups`
(a prefilter of an index, which compares strings exactly), so no second rule can drift
from this one.

What cannot be what anybody meant is refused rather than matched:

- a caller's groups that are not a list of strings (a bare string would be read as
  its characters), that are empty, or that hold a group that is empty, has whitespace
  at either end, or holds a control or format character (a tab, a zero-width space, a
  bidirectional override): `caller_groups`, before anything is embedded or read;
- an ACL that is not a list of strings or one string (one group), or an entry of one
  that is empty, has whitespace at either end or holds such a character: `Acl.read`
  (`AclUnreadable`, which the reader turns into a refusal naming the record, at
  planning). Such an entry could never be matched by a caller whose groups pass the
  rule above, so taking it as written would make a record silently invisible, and
  stripping it would guess a security label. A separator-split CSV cell keeps its
  documented trim around each group; what is left must pass the same rule.
"""

from __future__ import annotations

import functools
import json
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import orjson

from batchline.errors import ArgumentError

# A search asks for at most this many hits: beyond it a caller wants an export.
MAX_K = 100_000
# Control (Cc), format (Cf: zero-width and bidirectional marks), surrogate (Cs), private-use
# (Co) and unassigned (Cn) characters, and line and paragraph separators: none is part of a
# group name anybody types or reads.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def group_flaw(group: str) -> str | None:
    """Why `group` cannot be a group name as written, or None."""
    if group == "":
        return "is empty"
    if group[0].isspace() or group[-1].isspace():
        return "has whitespace at its start or end"
    for ch in group:
        if unicodedata.category(ch) in _REFUSED_CATEGORIES:
            return f"holds the character U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')})"
    return None


class AclUnreadable(ValueError):
    """A record's ACL cannot be read exactly as written; the message says why, and the reader
    that met it says where."""


class Acl:
    """A record's ACL: the groups that may read it, in the order written, each exactly as
    written (see the module's doc). Immutable; equal ACLs are equal."""

    __slots__ = ("_json", "groups")

    groups: tuple[str, ...]
    _json: str | None

    def __init__(self, groups: Iterable[str]) -> None:
        # Only `read` and `from_json` make one from outside this module, each after its check.
        object.__setattr__(self, "groups", tuple(groups))
        object.__setattr__(self, "_json", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("an Acl is immutable")

    @classmethod
    def read(cls, value: Any) -> Acl:
        """A record's ACL as its input holds it: a list of strings, or one string (one group).
        `AclUnreadable` for anything else, or for an entry no caller's group could equal."""
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, list | tuple):
            raise AclUnreadable(f"must be a list of strings (or one string), not {_shown(value)}")
        try:
            return _read(tuple(value))
        except TypeError:  # an unhashable entry (a list, a dict): not a string either
            return _read.__wrapped__(tuple(value))

    @staticmethod
    def from_json(text: str | None) -> Acl | None:
        """An ACL as the store holds it (`to_json`'s text; NULL for none)."""
        return None if text is None else _from_json(text)

    def to_json(self) -> str:
        """The one text form of an ACL: what the store keeps (so equal ACLs compare equal in
        SQL) and what a record's content hash reads."""
        if self._json is None:
            # Kept: an ACL shared by many records is written once for each of them.
            object.__setattr__(self, "_json", orjson.dumps(list(self.groups)).decode())
        assert self._json is not None
        return self._json

    def to_list(self) -> list[str]:
        """The groups as a list of strings: the `acl` column of every export and table."""
        return list(self.groups)

    def admits(self, groups: Groups) -> bool:
        """Whether a caller of `groups` may be served the record: some entry equals some group."""
        wanted = groups.names_set
        return any(entry in wanted for entry in self.groups)

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def __eq__(self, other: object) -> bool:
        # Equal to another Acl, or to the list (or tuple) of the same groups in the same order.
        if isinstance(other, Acl):
            return other.groups == self.groups
        return isinstance(other, list | tuple) and tuple(other) == self.groups

    def __hash__(self) -> int:
        return hash(self.groups)

    def __repr__(self) -> str:
        return f"Acl({list(self.groups)!r})"

    def __reduce__(self) -> tuple[type[Acl], tuple[tuple[str, ...]]]:
        # Pickled as its groups (a process pool, a copy): the default sets slots one by one.
        return (Acl, (self.groups,))


@functools.lru_cache(maxsize=4096)
def _from_json(text: str) -> Acl:
    # Results of one job share a handful of ACLs: each is read from its text once.
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise AclUnreadable(f"the stored ACL {text[:80]!r} is not JSON") from None
    if isinstance(value, str):
        return Acl((value,))
    if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
        raise AclUnreadable(f"the stored ACL {text[:80]!r} is not a list of strings")
    return Acl(value)


@functools.lru_cache(maxsize=4096)
def _read(value: tuple[Any, ...]) -> Acl:
    # The records of an input share a handful of ACLs: each is checked once (a planner reads
    # millions), and an ACL refused is never kept.
    if not all(isinstance(entry, str) for entry in value):
        raise AclUnreadable(f"must be a list of strings (or one string), not {_shown(list(value))}")
    for entry in value:
        flaw = group_flaw(entry)
        if flaw is not None:
            raise AclUnreadable(f"entry {entry!r} {flaw}; no caller's group can equal it, and batchline never "
                                "strips or guesses a security label: fix the record's ACL")
    return Acl(value)


def _shown(value: Any) -> str:
    return json.dumps(value, default=str)[:80]


class Groups:
    """A caller's groups, checked (made only by `caller_groups`): each a name as the records'
    ACLs hold it, once each, in the order given."""

    __slots__ = ("names", "names_set")

    names: tuple[str, ...]
    names_set: frozenset[str]

    def __init__(self, names: tuple[str, ...], _checked: object) -> None:
        if _checked is not _CHECKED:
            raise TypeError("a caller's Groups are made by batchline.acl.caller_groups, which checks them")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "names_set", frozenset(names))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Groups are immutable")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Groups):
            return other.names == self.names
        return isinstance(other, tuple) and other == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"Groups({list(self.names)!r})"


_CHECKED = object()


def caller_groups(groups: Any, where: str = "--groups") -> Groups:
    """The caller's groups as given, each checked; refused (`ArgumentError`, exit 2) in one
    line naming the first that cannot be a group, and refused when there are none: no
    groups is never read as all of them. Groups checked already are taken as they are."""
    if isinstance(groups, Groups):
        return groups
    if isinstance(groups, str | bytes):
        raise ArgumentError(f"{where}: the caller's groups must be a list of group names, not the string "
                            f"{groups!r} (which would be read as its characters): pass [{groups!r}]")
    if groups is None:
        groups = ()
    try:
        given = list(groups)
    except TypeError:
        raise ArgumentError(f"{where}: the caller's groups must be a list of group names, not "
                            f"{type(groups).__name__}") from None
    for g in given:
        if not isinstance(g, str):
            raise ArgumentError(f"{where}: group {g!r} is not a string; every group is a name")
        flaw = group_flaw(g)
        if flaw is not None:
            raise ArgumentError(f"{where}: group {g!r} {flaw}; groups are matched exactly as written, "
                                "so give the name as the records' ACLs hold it")
    if not given:
        raise ArgumentError(f"a search needs the caller's groups ({where} G1,G2): only rows whose ACL names one "
                            "of them are searched, and no groups is not all of them")
    return Groups(tuple(dict.fromkeys(given)), _CHECKED)


def split_groups_option(values: Sequence[str]) -> list[str]:
    """`--groups a,b` (given once or more) as the groups it names, commas separating them;
    a value that looks like a JSON array is refused with the form to use."""
    out: list[str] = []
    for value in values:
        if value.lstrip().startswith("["):
            raise ArgumentError(f"--groups {value!r} looks like a JSON array; give the groups separated by commas "
                                "(--groups G1,G2) or repeat the option (--groups G1 --groups G2)")
        out.extend(value.split(","))
    return out


def check_k(k: Any) -> int:
    """The number of hits a search asks for, within 1..MAX_K."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ArgumentError(f"k must be a whole number from 1 to {MAX_K:,}, not {k!r}")
    return k


def admits(acl: Acl | None, groups: Groups) -> bool:
    """Whether a record whose ACL is `acl` may be served to a caller of `groups`: some entry
    equals some group, exactly. A null ACL admits nobody. Groups given as a plain list are
    checked first (`caller_groups`), never taken unchecked."""
    return acl is not None and acl.admits(caller_groups(groups))


def group_filter(groups: Groups, column: str = "acl") -> str:
    """The prefilter an index searches a caller of `groups` under, over a list-of-strings
    `column`: SQL string literals, quotes doubled, each group exactly as `caller_groups` took
    it (which refuses control characters, so nothing but a quote needs escaping)."""
    quoted = ", ".join("'" + g.replace("'", "''") + "'" for g in caller_groups(groups))
    return f"{column} IS NOT NULL AND array_has_any({column}, [{quoted}])"
