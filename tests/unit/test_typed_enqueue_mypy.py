"""mypy checks ``task.enqueue(...)`` against the task's own signature: the docs' example
passes ``mypy --strict``, and the same file with a wrong-arity call, an unknown keyword
or a wrong type is rejected with the error a user would see."""

from __future__ import annotations

from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "typed_enqueue.py"


def _mypy(path: Path) -> tuple[str, int]:
    """mypy in this process (its API), as ``mypy --strict path`` prints and exits."""
    out, err, status = api.run(["--strict", "--no-error-summary", str(path)])
    return out + err, status


def test_mypy_accepts_the_example_and_rejects_wrong_calls(tmp_path: Path) -> None:
    out, status = _mypy(EXAMPLE)
    assert status == 0, out
    wrong = tmp_path / "wrong_enqueue.py"
    wrong.write_text(
        EXAMPLE.read_text()
        + "\n\nasync def wrong() -> None:\n"
        + '    await send_email.enqueue("a", "b", "c")\n'
        + '    await send_email.options(queue="mail").enqueue("a", sender="x")\n'
        + "    send_email.enqueue_sync(42)\n"
    )
    out, status = _mypy(wrong)
    assert status == 1, out
    assert 'Too many positional arguments for "enqueue" of "Task"' in out, out
    assert 'Unexpected keyword argument "sender" for "enqueue" of "TaskCall"' in out, out
    assert 'Argument 1 to "enqueue_sync" of "Task" has incompatible type "int"' in out, out
