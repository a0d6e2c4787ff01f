"""The docs harness's pure half: a page's blocks are read, and a changed output fails.

``tests/e2e/test_docs_pages.py`` runs the pages; these tests hold the comparison and the
reading to what docs/contributing.md ("Docs that run") promises, so a page whose shown
output drifts from the code cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doc_blocks import (
    DocBlockError,
    Ids,
    compare,
    expected_exit,
    python_script,
    read_blocks,
)

JOB = "414e5596-b356-4f7a-a8a1-9efac349f99c"
REAL = "7667dae0-980f-4fec-bdf3-237f49105671"
OTHER = "86f378de-3146-4a3f-b016-5d87ed091699"


def test_the_same_output_matches() -> None:
    assert compare(["a", "  b: 1"], ["a", "  b: 1  ", ""], Ids()) is None


@pytest.mark.parametrize(
    "real",
    [
        ['  "max_attempts": 5,'],  # a changed value
        ['  "max_attempts": 4,', "extra"],  # a line the page does not show
        [],  # nothing printed
    ],
)
def test_a_changed_output_fails(real: list[str]) -> None:
    assert compare(['  "max_attempts": 4,'], real, Ids()) is not None


def test_the_mismatch_names_the_first_shown_line_not_matched() -> None:
    mismatch = compare(["one", "two", "three"], ["one", "2", "three"], Ids())
    assert mismatch is not None and mismatch.shown_line == 1
    assert "'two'" in mismatch.detail


def test_an_ellipsis_is_any_text_within_a_line_only() -> None:
    assert (
        compare(["… INFO main … port=7390"], ["2026-12-02 INFO main id=1 port=7390"], Ids()) is None
    )
    assert compare(["... INFO x"], ["t INFO x"], Ids()) is None
    assert compare(["a … c"], ["a b", "c"], Ids()) is not None


def test_a_gap_line_is_any_number_of_lines() -> None:
    assert compare(["first", "…", "last"], ["first", "x", "y", "last"], Ids()) is None
    assert compare(["first", "…", "last"], ["first", "last"], Ids()) is None
    assert compare(["first", "…", "last"], ["first", "x"], Ids()) is not None


def test_times_match_any_time_and_nothing_else() -> None:
    shown = ['  "run_at": "2026-11-29T19:41:49.010870+00:00",']
    assert compare(shown, ['  "run_at": "2030-01-01T00:00:00.5+00:00",'], Ids()) is None
    assert compare(shown, ['  "run_at": null,'], Ids()) is not None


def test_a_shown_uuid_binds_to_the_real_one_and_must_stay_it() -> None:
    ids = Ids()
    assert compare([JOB], [REAL], ids) is None
    assert ids.bound == {JOB: REAL}
    assert ids.substitute(f"broker job {JOB} --json") == f"broker job {REAL} --json"
    assert compare([f'{{"job_id": "{JOB}"}}'], [f'{{"job_id": "{OTHER}"}}'], ids) is not None
    assert compare([f'{{"job_id": "{JOB}"}}'], [f'{{"job_id": "{REAL}"}}'], ids) is None


def test_a_failed_match_binds_nothing() -> None:
    ids = Ids()
    assert compare([JOB, "done"], [REAL, "not done"], ids) is not None
    assert ids.bound == {}


def test_a_log_finds_its_lines_in_order_among_others() -> None:
    log = ["start", "x INFO a", "noise", "x INFO b", "end"]
    assert compare(["… INFO a", "… INFO b"], log, Ids(), anywhere=True) is None
    assert compare(["… INFO b", "… INFO a"], log, Ids(), anywhere=True) is not None


def test_a_shown_exit_status_is_read_off_the_output() -> None:
    assert expected_exit(["error: no", "[exit 2]"]) == (["error: no"], 2)
    assert expected_exit(["fine"]) == (["fine"], 0)


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_an_unmarked_block_that_cannot_run_is_an_error_naming_page_and_line(
    tmp_path: Path,
) -> None:
    page = _page(tmp_path, "# T\n\n```python\nprint(1)\n```\n\n```sh\nbroker status\n```\n")
    with pytest.raises(DocBlockError, match=r"page\.md:7 \(```sh block\) is not run"):
        read_blocks(page, "page.md")


def test_a_marked_block_is_read_with_its_directive(tmp_path: Path) -> None:
    text = (
        "<!-- docs-test: skip a production host -->\n```sh\nbroker-main --host 10.0.0.5\n```\n"
        "<!-- docs-test: file myapp/tasks.py -->\n\n```python\nx = 1\n```\n"
        "<!-- docs-test: main -->\n"
        "```console\n$ broker enqueue t '[]' \\\n    --json\n{}\n$ broker tasks\n…\n```\n"
    )
    blocks = read_blocks(_page(tmp_path, text), "page.md")
    assert [(b.kind, b.arg) for b in blocks] == [
        ("skip", "a production host"),
        ("file", "myapp/tasks.py"),
        ("main", ""),
        ("run", ""),
    ]
    [enqueue, tasks] = blocks[-1].commands()
    assert (enqueue.text, enqueue.shown, enqueue.line) == (
        "broker enqueue t '[]' --json",
        ["{}"],
        12,
    )
    assert (tasks.text, tasks.shown) == ("broker tasks", ["…"])


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: skip -->\n```sh\nx\n```\n",  # a skip says why
        "<!-- docs-test: later -->\n```sh\nx\n```\n",  # an unknown directive
        "<!-- docs-test: skip why -->\nsome prose\n```sh\nx\n```\n",  # not right before
        "```console\noutput first\n$ broker status\n```\n",
        "<!-- docs-test: background ready -->\n```console\n$ a\n$ b\n```\n",
        "<!-- docs-test: given -->\n```python\nx\n```\n",  # given what?
        "<!-- docs-test: given x = 1 -->\n```console\n$ a\n```\n",  # Python only
    ],
)
def test_a_malformed_page_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(DocBlockError, match=r"page\.md:\d+"):
        read_blocks(_page(tmp_path, text), "page.md")


def test_a_given_line_runs_before_its_block_and_top_level_await_is_told(tmp_path: Path) -> None:
    text = (
        "<!-- docs-test: given import asyncio; n = 2 -->\n```python\nawait asyncio.sleep(n)\n```\n"
        "```python\nimport asyncio\n\nasync def f() -> None:\n    await asyncio.sleep(0)\n```\n"
        "```python\nawait = 1 +\n```\n"
    )
    given, plain, broken = read_blocks(_page(tmp_path, text), "page.md")
    assert (given.kind, given.arg) == ("given", "import asyncio; n = 2")
    assert python_script(given) == ("import asyncio; n = 2\nawait asyncio.sleep(n)", True)
    assert python_script(plain)[1] is False  # an await inside a coroutine is no reason
    with pytest.raises(SyntaxError):
        python_script(broken)
