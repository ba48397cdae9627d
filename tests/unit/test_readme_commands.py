"""The README's table of commands is the parser's own usage, so the two cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

from batchline.cli import usage

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_command_table_is_the_one_rendered_from_the_parser() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = usage.render()
    assert block in readme, "README.md's command table differs from the parser: run `make readme`"


def test_the_readme_names_the_options_its_hand_kept_table_had_missed() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for usage_part in ("batchline run [--store URL] [--workers N] [--log-dir DIR] [--publish]",
                       "batchline rollback [--store URL] [--reason REASON] NAME", "[--watch] [--interval SECONDS]",
                       "[--poll-seconds SECONDS] [--store-wait SECONDS]", "[--metrics-addr ADDR]",
                       "`BATCHLINE_LOG_DIR`"):
        assert usage_part in readme


def test_every_environment_variable_the_package_reads_is_in_the_table() -> None:
    read = {m for path in (ROOT / "batchline").rglob("*.py")
            for m in re.findall(r"\bBATCHLINE_[A-Z_]+\b", path.read_text(encoding="utf-8"))}
    assert read == set(usage.ENVIRONMENT)


def test_check_fails_on_a_stale_table_and_write_renders_it(tmp_path: Path) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"# x\n\n{usage.BEGIN}\nbatchline run JOB.yaml   plan if new, run, validate\n{usage.END}\nrest\n")
    assert usage.main(["--check", str(stale)]) == 1
    assert usage.main(["--write", str(stale)]) == 0
    assert usage.main(["--check", str(stale)]) == 0
    assert stale.read_text() == f"# x\n\n{usage.render()}\nrest\n"
