"""The paging flags of `describe`, `history` and `events` (the pages: tests/workflows/test_whole_history.py)."""

from __future__ import annotations

from tests.test_cli import NOWHERE, astraeus


def test_a_page_is_asked_with_counts_and_never_with_follow() -> None:
    for verb in ("describe", "history", "events"):
        after = astraeus(verb, "hello", "--after=-1", "--temporal", NOWHERE)
        assert after.returncode == 2 and "argument --after: '-1': expected a number, 0 or more" in after.stderr
        limit = astraeus(verb, "hello", "--limit", "0", "--temporal", NOWHERE)
        assert limit.returncode == 2 and "argument --limit: '0': expected a number, 1 or more" in limit.stderr
    follow = astraeus("events", "hello", "--follow", "--limit", "5", "--temporal", NOWHERE)  # refused before connecting
    assert (follow.returncode, follow.stderr) == (2, "astraeus: --after and --limit do not apply with --follow (it "
                                                     "prints every event)\n")  # fmt: skip
    assert astraeus("ls", "--after", "5").returncode == 2  # ls pages with --page
