"""Jobs for the observability tests: hostile text in records and in model output,
and the HTML parsing the escaping tests read a page with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from batchline.check.validate import validate
from batchline.publish.pointer import publish
from batchline.store import Store
from tests.helpers import planned, run_to_seal

# Untrusted strings: record ids and texts (the input) and labels (model output).
EVIL_ID = '"><img src=x onerror="document.documentElement.setAttribute(\'data-pwned\',\'id\')">'
EVIL_INVALID_ID = "</td></table><script>document.documentElement.setAttribute('data-pwned','row')</script>"
EVIL_LABEL = "<script>document.documentElement.setAttribute('data-pwned','label')</script>"
EVIL_NEW_LABEL = "<svg onload=\"document.documentElement.setAttribute('data-pwned','svg')\">"
EVIL_TEXT = "<b>bold</b> <iframe src=\"javascript:alert(1)\"></iframe> & more"
EVIL = (EVIL_ID, EVIL_INVALID_ID, EVIL_LABEL, EVIL_NEW_LABEL)


def schema(categories: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"category": {"enum": categories}, "summary": {"type": "string", "maxLength": 80}},
        "required": ["category", "summary"],
        "additionalProperties": False,
    }


def records(n: int = 40) -> list[dict[str, Any]]:
    out = [{"id": f"r{i:03d}", "text": f"{EVIL_TEXT} number {i}", "acl": None} for i in range(n)]
    out[3]["id"] = EVIL_ID
    out[7]["id"] = EVIL_INVALID_ID
    return out


@dataclass
class HostileJob:
    published: str
    version: str


def hostile_job(job_factory: Callable[..., Path], store: Store) -> HostileJob:
    """Two versions of a job whose ids, texts and labels carry markup: the first is
    published, the second (one more category, so drift fails validation and the
    validation figures quote the hostile label) is sealed and validated."""
    common = {"options": {"error_on": [EVIL_ID], "invalid_on": [EVIL_INVALID_ID]},
              "shards": {"size": 15}, "validate": {"max_dead_letter_rate": 0.2}}
    first = job_factory(records(), schema=schema(["plain", EVIL_LABEL, "other"]), name="hostile",
                        output={"schema": "schema.json", "label_field": "category"}, **common)
    _spec, v1 = planned(first, store)
    run_to_seal(store, v1)
    assert validate(store, v1).passed
    publish(store, v1)
    second = job_factory(records(), schema=schema(["plain", EVIL_LABEL, "other", EVIL_NEW_LABEL]),
                         name="hostile", output={"schema": "schema.json", "label_field": "category"}, **common)
    _spec, v2 = planned(second, store)
    run_to_seal(store, v2)
    assert not validate(store, v2).passed  # a new category: drift
    return HostileJob(v1, v2)


class Page(HTMLParser):
    """What the tests look for in a page: every tag, attribute and script."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str, str | None]] = []
        self.scripts: list[str] = []
        self.root_attrs: dict[str, str | None] = {}
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend((tag, k, v) for k, v in attrs)
        if tag == "html":
            self.root_attrs = dict(attrs)
        if tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page
