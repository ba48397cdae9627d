"""Access rules: a record's ACL, a caller's groups, and the one rule that compares them (I6).

A caller's group matches an ACL entry only when the two strings are equal: nothing
is stripped, case-folded or Unicode-normalised, here or anywhere else. Every
comparison of a caller's groups with an ACL goes through `admits` (in Python) or is
given the groups `caller_groups` returned (a prefilter of an index, which compares
strings exactly), so no second rule can drift from this one.

What cannot be what anybody meant is refused rather than matched:

- a caller's groups that are not a list of strings (a bare string would be read as
  its characters), that are empty, or that hold a group that is empty, has whitespace
  at either end, or holds a control or format character (a tab, a zero-width space, a
  bidirectional override): `caller_groups`, before anything is embedded or read;
- an ACL entry of a record read from a JSON array, a Parquet or Delta list, or a
  JSON-array CSV cell that is empty, has whitespace at either end or holds such a
  character: `acl_entry_refusal`, at planning, naming the record. Such an entry could
  never be matched by a caller whose groups pass the rule above, so taking it as
  written would make a record silently invisible, and stripping it would guess a
  security label. A separator-split CSV cell keeps its documented trim around each
  group; what is left must pass the same rule.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any

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


def caller_groups(groups: Any, where: str = "--groups") -> tuple[str, ...]:
    """The caller's groups as given, each checked; refused (`ArgumentError`, exit 2) in one
    line naming the first that cannot be a group, and refused when there are none: no
    groups is never read as all of them."""
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
    return tuple(dict.fromkeys(given))


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


def admits(acl: Iterable[str] | None, groups: Sequence[str]) -> bool:
    """Whether a record whose ACL is `acl` may be served to a caller of `groups` (checked by
    `caller_groups`): some entry equals some group, exactly. A null ACL admits nobody."""
    if acl is None or isinstance(acl, str | bytes):
        # A bare string is never read as its characters; one group is a list of one.
        return isinstance(acl, str) and acl in groups
    wanted = set(groups)
    return any(entry in wanted for entry in acl)


def acl_entry_refusal(acl: Sequence[Any]) -> str | None:
    """Why an ACL read as a list (a JSON array, a Parquet or Delta list) cannot be taken as
    written, or None: an entry that is not a string, or that `group_flaw` refuses."""
    for entry in acl:
        if not isinstance(entry, str):
            return f"entry {entry!r} is not a string"
        flaw = group_flaw(entry)
        if flaw is not None:
            return (f"entry {entry!r} {flaw}; no caller's group can equal it, and batchline never strips or "
                    "guesses a security label: fix the record's ACL")
    return None
