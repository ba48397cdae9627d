"""Prompts: the shared instruction prefix first, then the record in a delimited block.

The prefix is identical for every record of a job, so an engine with prefix
caching computes it once. Record text is untrusted: it goes inside the block,
and any of the block's own markers inside it are neutralised so the text
cannot close the block early and pose as instructions.
"""

from __future__ import annotations

import re

OPEN = "<record>"
CLOSE = "</record>"
RECORD_PLACEHOLDER = "{record}"

_MARKER = re.compile(r"<\s*/?\s*record\s*>", re.IGNORECASE)


def split_template(template: str) -> tuple[str, str]:
    """(prefix, suffix) around the record block; without a placeholder the block goes last."""
    if RECORD_PLACEHOLDER in template:
        prefix, _, suffix = template.partition(RECORD_PLACEHOLDER)
        return prefix, suffix
    return template.rstrip("\n") + "\n", ""


def neutralise(text: str) -> str:
    return _MARKER.sub(lambda m: m.group(0).replace("<", "\u2039").replace(">", "\u203a"), text)


def render(prefix: str, suffix: str, text: str, examples: str = "") -> str:
    """The record's prompt; `examples`, where the job retrieves some, come after the shared
    prefix (which an engine caches) and just before the record."""
    return f"{prefix}{examples}{OPEN}\n{neutralise(text)}\n{CLOSE}\n{suffix}"
