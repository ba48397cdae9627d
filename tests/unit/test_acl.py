"""The one ACL type and the one rule that compares a caller's groups with it (batchline.acl), and
the prefilter an index is given (group_filter): exact strings, or a refusal; never a guess."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.acl import (
    MAX_K,
    Acl,
    AclUnreadable,
    Groups,
    admits,
    caller_groups,
    check_k,
    group_filter,
    split_groups_option,
)
from batchline.errors import ArgumentError
from batchline.snapshot.reading import content_hash

SERVED, WITHHELD = "served", "withheld"
NO_ACL = object()  # a record whose ACL is null in the store (an input read without acl_field)

# Every case that matters, in one table: a record's ACL as its input holds it, the caller's
# groups as given, and what happens: served, withheld, or refused (the record's ACL at reading,
# naming why; the caller's groups before anything is read, naming why).
CASES: list[tuple[Any, Any, str]] = [
    # plain names, matched exactly
    (["g1"], ["g1"], SERVED),
    (["g1", "g2"], ["g1"], SERVED),
    (["g1", "g2"], ["nobody", "g2"], SERVED),
    ("hr", ["hr"], SERVED),  # one string is one group...
    ("hr", ["h"], WITHHELD),  # ...never its characters
    (["it service desk"], ["it service desk"], SERVED),  # inner spaces are part of a name
    (["it  service desk"], ["it service desk"], WITHHELD),
    # empty, null, missing
    ([], ["g1"], WITHHELD),  # an empty list admits nobody
    (NO_ACL, ["g1"], WITHHELD),  # a null ACL admits nobody
    (None, ["g1"], "ACL refused: must be a list of strings (or one string), not null"),
    (["g1"], [], "groups refused: needs the caller's groups"),
    (["g1"], None, "groups refused: needs the caller's groups"),
    (["g1", ""], ["g1"], "ACL refused: entry '' is empty"),
    (["g1"], [""], "groups refused: is empty"),
    # not a list of strings
    (7, ["g1"], "ACL refused: must be a list of strings (or one string), not 7"),
    ([1, "x"], ["x"], 'ACL refused: must be a list of strings (or one string), not [1, "x"]'),
    ({"g1": True}, ["g1"], 'ACL refused: must be a list of strings (or one string), not {"g1": true}'),
    (["g1"], "g1", "groups refused: not the string 'g1'"),
    (["g1"], b"g1", "groups refused: not the string"),
    (["g1"], ["g1", None], "groups refused: group None is not a string"),
    (["g1"], ["g1", 7], "groups refused: group 7 is not a string"),
    (["g1"], 7, "groups refused: not int"),
    # quotes, commas and SQL fragments are characters of a name, never syntax
    (["o'brien"], ["o'brien"], SERVED),
    (['say "hi"'], ['say "hi"'], SERVED),
    (["a,b"], ["a", "b"], WITHHELD),
    (["a", "b"], ["a,b"], WITHHELD),
    (["a,b"], ["a,b"], SERVED),
    (["g1"], ["' OR '1'='1"], WITHHELD),
    (["g1"], ["g1') OR TRUE --"], WITHHELD),
    (["g1') OR TRUE --"], ["g1') OR TRUE --"], SERVED),
    (["anything"], ["%"], WITHHELD),  # no pattern matching
    (["anything"], ["*"], WITHHELD),
    # padding: refused on both sides, never stripped
    (["g1 "], ["g1"], "ACL refused: entry 'g1 ' has whitespace at its start or end"),
    ([" g1"], ["g1"], "ACL refused: entry ' g1' has whitespace at its start or end"),
    (["g1"], [" g1"], "groups refused: has whitespace at its start or end"),
    (["g1"], ["g1 "], "groups refused: has whitespace at its start or end"),
    (["g1"], ["\tg1"], "groups refused: has whitespace at its start or end"),
    (["g1"], ["g1\n"], "groups refused: has whitespace at its start or end"),
    (["g1"], ["\u3000g1"], "groups refused: has whitespace at its start or end"),  # ideographic space
    (["g1"], ["g1\u00a0"], "groups refused: has whitespace at its start or end"),  # no-break space
    # control and format characters
    (["g1"], ["g1\x1f"], "groups refused: has whitespace at its start or end"),  # whitespace to Python
    (["g1"], ["g\x1f1"], "groups refused: U+001F"),
    (["g1"], ["g\x00 1"], "groups refused: U+0000"),
    (["g1"], ["g1\u200b"], "groups refused: U+200B"),  # zero-width space
    (["g1"], ["\u202eg1"], "groups refused: U+202E"),  # right-to-left override
    (["g1"], ["g\u20281"], "groups refused: U+2028"),  # line separator
    (["g\x071"], ["g1"], "ACL refused: entry 'g\\x071' holds the character U+0007"),
    (["g\u200b1"], ["g1"], "ACL refused: entry 'g\\u200b1' holds the character U+200B"),
    # Unicode forms: never folded or normalised
    (["G1"], ["g1"], WITHHELD),
    (["g1"], ["G1"], WITHHELD),
    (["STRASSE"], ["straße"], WITHHELD),
    (["e\u0301"], ["é"], WITHHELD),  # NFD against NFC
    (["é"], ["e\u0301"], WITHHELD),
    (["é"], ["é"], SERVED),
    (["g1"], ["\uff471"], WITHHELD),  # a full-width letter is another letter
]


@pytest.mark.parametrize(("acl", "groups", "outcome"), CASES)
def test_one_rule_serves_withholds_or_refuses_every_acl_and_caller(acl: Any, groups: Any, outcome: str) -> None:
    try:
        record = None if acl is NO_ACL else Acl.read(acl)
    except AclUnreadable as exc:
        assert outcome.startswith("ACL refused: ") and outcome.removeprefix("ACL refused: ") in str(exc)
        assert "\n" not in str(exc)
        return
    try:
        caller = caller_groups(groups)
    except ArgumentError as exc:
        assert outcome.startswith("groups refused: ") and outcome.removeprefix("groups refused: ") in str(exc)
        assert exc.exit_code == 2 and "\n" not in str(exc)
        return
    assert outcome in (SERVED, WITHHELD), f"{acl!r} and {groups!r} were taken: {outcome}"
    assert admits(record, caller) is (outcome == SERVED)
    if record is not None:
        # Read back from the store's text form, the same ACL decides the same way.
        again = Acl.from_json(record.to_json())
        assert again == record and admits(again, caller) is (outcome == SERVED)


def test_an_acl_keeps_its_entries_and_their_order_exactly_and_so_every_pinned_hash() -> None:
    acl = Acl.read(["b", "a", "o'brien", "é"])
    assert acl.to_list() == ["b", "a", "o'brien", "é"] and acl.to_json() == '["b","a","o\'brien","é"]'
    # A record's content hash reads the ACL's text form: the same bytes as before the type (0.1.0's hash).
    assert content_hash("text", acl) == content_hash("text", Acl(["b", "a", "o'brien", "é"]))
    assert content_hash("hello", Acl(["g1"])) == "72f1f979b2a9d3072ce7f29b2bf39820"
    assert content_hash("hello", Acl(["g1"])) != content_hash("hello", Acl(["g1", "g2"])) != content_hash("hello", None)
    assert Acl.read("hr") == Acl(["hr"]) == ["hr"]


def test_an_acl_in_the_store_that_is_not_a_list_of_strings_is_refused_not_guessed() -> None:
    for text in ("7", '{"g1": true}', '["g1", 3]', "not json"):
        with pytest.raises(AclUnreadable):
            Acl.from_json(text)
    assert Acl.from_json(None) is None
    assert Acl.from_json('"hr"') == Acl(["hr"])  # one group, as the input's one string is


def test_an_acl_and_a_callers_groups_cannot_be_changed_or_made_unchecked() -> None:
    acl = Acl.read(["g1"])
    with pytest.raises(AttributeError):
        acl.groups = ("everyone",)  # type: ignore[misc]
    groups = caller_groups(["g1"])
    with pytest.raises(AttributeError):
        groups.names = ("everyone",)  # type: ignore[misc]
    with pytest.raises(TypeError):
        Groups(("everyone",), object())


def test_an_acl_failed_to_pickle_or_copy_and_now_comes_back_equal() -> None:
    import copy
    import pickle

    acl = Acl.read(["g1", "g 2"])
    assert acl.to_json() == '["g1","g 2"]'
    for again in (pickle.loads(pickle.dumps(acl)), copy.copy(acl), copy.deepcopy(acl)):
        assert again == acl and again.to_json() == acl.to_json()
        with pytest.raises(AttributeError):
            again.groups = ("everyone",)  # type: ignore[misc]


def test_an_acl_read_again_is_the_one_checked_before_and_a_refused_one_is_refused_every_time() -> None:
    first = Acl.read(["g1", "g2"])
    assert Acl.read(("g1", "g2")) is first
    assert Acl.read(["g2", "g1"]) is not first  # the order is the ACL's: another one
    for _ in range(3):
        with pytest.raises(AclUnreadable, match="whitespace"):
            Acl.read(["g1", " g2"])
        with pytest.raises(AclUnreadable, match="list of strings"):
            Acl.read(["g1", ["g2"]])  # unhashable: checked without the cache
        with pytest.raises(AclUnreadable, match="list of strings"):
            Acl.read(["g1", 2])


def test_caller_groups_are_kept_as_given_once_each() -> None:
    assert caller_groups(["b", "a", "b", "it service desk"]) == ("b", "a", "it service desk")
    checked = caller_groups(["g1"])
    assert caller_groups(checked) is checked


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
    assert group_filter(caller_groups(groups)) == where


@pytest.mark.parametrize("groups", [[" g1"], ["g1\x00"], [], "g1", ["g1", None]])
def test_the_prefilter_refuses_what_the_caller_check_refuses(groups: Any) -> None:
    with pytest.raises(ArgumentError):
        group_filter(groups)
