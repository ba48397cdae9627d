"""The one rule that compares a caller's groups with a record's ACL (batchline.acl), and the
prefilter an index is given (group_filter): exact strings, or a refusal; never a guess."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.acl import (
    MAX_K,
    acl_entry_refusal,
    admits,
    caller_groups,
    check_k,
    split_groups_option,
)
from batchline.errors import ArgumentError
from batchline.targets.lancedb_index import group_filter

# (caller's groups, a record's ACL, whether it is served). Every case that is not the
# same string in both is refused service, whatever it looks like to a person.
MATCHES: list[tuple[list[str], list[str] | None, bool]] = [
    (["g1"], ["g1"], True),
    (["g1"], ["g1", "g2"], True),
    (["nobody", "g2"], ["g1", "g2"], True),
    (["g1"], ["G1"], False),  # case is not folded
    (["G1"], ["g1"], False),
    (["straße"], ["STRASSE"], False),
    (["é"], ["e\u0301"], False),  # NFC against NFD: not normalised
    (["e\u0301"], ["é"], False),
    (["\uff471"], ["g1"], False),  # a full-width letter is another letter
    (["g1"], ["g1 "], False),  # a padded ACL entry is never matched (and refused at planning)
    (["g1"], [" g1"], False),
    (["g1"], None, False),  # a null ACL admits nobody
    (["g1"], [], False),
    (["it service desk"], ["it service desk"], True),  # inner spaces are part of a name
    (["it service desk"], ["it  service desk"], False),
    (["o'brien"], ["o'brien"], True),
    (["a,b"], ["a", "b"], False),  # a comma is a character of a group, not a separator here
    (["a"], ["a,b"], False),
    (["%"], ["anything"], False),  # no pattern matching
    (["*"], ["anything"], False),
    (["' OR '1'='1"], ["g1"], False),
    (["g1') OR TRUE --"], ["g1"], False),
]


@pytest.mark.parametrize(("groups", "acl", "served"), MATCHES)
def test_a_caller_is_served_a_record_only_where_a_group_equals_an_acl_entry(
        groups: list[str], acl: list[str] | None, served: bool) -> None:
    assert admits(acl, caller_groups(groups)) is served


def test_a_bare_string_acl_is_one_group_never_its_characters() -> None:
    assert admits("hr", ["hr"]) is True
    assert admits("hr", ["h"]) is False


# Caller groups that cannot be what the caller meant: each refused in one line naming it.
REFUSED_GROUPS: list[tuple[Any, str]] = [
    ([""], "is empty"),
    ([" g1"], "whitespace at its start or end"),
    (["g1 "], "whitespace at its start or end"),
    (["\tg1"], "whitespace at its start or end"),
    (["g1\n"], "whitespace at its start or end"),
    (["\u3000g1"], "whitespace at its start or end"),  # ideographic space
    (["g1\u00a0"], "whitespace at its start or end"),  # no-break space
    (["g1\x1f"], "whitespace at its start or end"),  # the unit separator is whitespace to Python
    (["g\x1f1"], "U+001F"),
    (["g\x00 1"], "U+0000"),
    (["g1\u200b"], "U+200B"),  # zero-width space
    (["\u202eg1"], "U+202E"),  # right-to-left override
    (["g\u20281"], "U+2028"),  # line separator
    (["g1", None], "is not a string"),
    (["g1", 7], "is not a string"),
    ("it-service-desk", "not the string 'it-service-desk'"),
    (b"g1", "not the string"),
    ([], "needs the caller's groups"),
    (None, "needs the caller's groups"),
    (7, "not int"),
]


@pytest.mark.parametrize(("groups", "why"), REFUSED_GROUPS)
def test_a_caller_group_that_cannot_be_a_group_is_refused_in_one_line(groups: Any, why: str) -> None:
    with pytest.raises(ArgumentError) as refused:
        caller_groups(groups)
    assert why in str(refused.value) and "\n" not in str(refused.value)
    assert refused.value.exit_code == 2


def test_caller_groups_are_kept_as_given_once_each() -> None:
    assert caller_groups(["b", "a", "b", "it service desk"]) == ("b", "a", "it service desk")


@pytest.mark.parametrize(("acl", "why"), [
    (["g1 "], "whitespace at its start or end"),
    ([" g1"], "whitespace at its start or end"),
    (["g1", ""], "is empty"),
    (["g\x071"], "U+0007"),
    (["g1", 3], "is not a string"),
])
def test_a_padded_or_control_character_acl_entry_is_refused_naming_it(acl: list[Any], why: str) -> None:
    refusal = acl_entry_refusal(acl)
    assert refusal is not None and why in refusal


def test_an_acl_of_plain_names_is_taken_as_written() -> None:
    assert acl_entry_refusal(["it-service-desk", "HR Confidential", "o'brien", "é", "a,b"]) is None
    assert acl_entry_refusal([]) is None


@pytest.mark.parametrize(("values", "groups"), [
    (["a,b"], ["a", "b"]),
    (["a", "b"], ["a", "b"]),  # --groups a --groups b takes both
    (["a,b", "c"], ["a", "b", "c"]),
    ([" a"], [" a"]),  # split, never stripped: the check that follows refuses it
])
def test_the_groups_option_splits_on_commas_and_takes_every_repeat(values: list[str], groups: list[str]) -> None:
    assert split_groups_option(values) == groups


@pytest.mark.parametrize("value", ['["a", "b"]', ' ["a"]', "[a]"])
def test_a_groups_option_that_looks_like_a_json_array_is_refused_with_the_form_to_use(value: str) -> None:
    with pytest.raises(ArgumentError, match=r"looks like a JSON array; give the groups separated by commas"):
        split_groups_option([value])


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1, 2**63, True, 1.5, "3", None])
def test_k_outside_its_bounds_is_refused_in_one_line(k: Any) -> None:
    with pytest.raises(ArgumentError, match=r"k must be a whole number from 1 to 100,000"):
        check_k(k)


def test_k_at_its_bounds_is_taken() -> None:
    assert (check_k(1), check_k(MAX_K)) == (1, MAX_K)


@pytest.mark.parametrize(("groups", "where"), [
    (["g1"], "acl IS NOT NULL AND array_has_any(acl, ['g1'])"),
    (["o'brien", "g2"], "acl IS NOT NULL AND array_has_any(acl, ['o''brien', 'g2'])"),
    (["') OR TRUE --"], "acl IS NOT NULL AND array_has_any(acl, [''') OR TRUE --'])"),
    (["a\\b"], "acl IS NOT NULL AND array_has_any(acl, ['a\\b'])"),
])
def test_the_prefilter_quotes_each_group_as_one_literal(groups: list[str], where: str) -> None:
    assert group_filter(groups) == where


@pytest.mark.parametrize("groups", [[" g1"], ["g1\x00"], [], "g1", ["g1", None]])
def test_the_prefilter_refuses_what_the_caller_check_refuses(groups: Any) -> None:
    with pytest.raises(ArgumentError):
        group_filter(groups)
