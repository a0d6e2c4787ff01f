"""``broker.__all__`` is the public surface: what a user imports, all of it importable,
every exception of the tree among it (what importing it costs is asked of a fresh
interpreter, in ``tests/integration/test_imports.py``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import broker
from broker import exceptions

REPO = Path(__file__).resolve().parents[2]
USER_FACING = {"task", "Client", "SyncClient", "Reschedule", "Schedule"}


def test_every_exported_name_resolves_and_the_user_facing_ones_are_there() -> None:
    assert set(broker.__all__) >= USER_FACING
    assert sorted(broker.__all__) == broker.__all__, "kept sorted, so a diff shows what changed"
    for name in broker.__all__:
        assert getattr(broker, name) is not None, name


def test_every_exception_of_the_tree_is_exported() -> None:
    tree = {
        name
        for name, value in vars(exceptions).items()
        if inspect.isclass(value) and issubclass(value, exceptions.BrokerError)
    }
    assert tree <= set(broker.__all__)
    assert all(getattr(broker, name) is getattr(exceptions, name) for name in tree)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        broker.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("broker.NoSuchThing resolved")


def test_no_two_public_types_share_a_name() -> None:
    """A class or union type alias defined at the top of one module of ``broker``,
    ``adapters`` or ``runners`` never shares its name with another's, so ``Job`` is one
    thing wherever it is read (the wire's message is ``JobHandoff``, a runner's result
    ``RunOutcome``)."""
    defined: dict[str, list[str]] = {}
    for package in ("broker", "adapters", "runners"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                for name in _type_names(node):
                    if not name.startswith("_"):
                        defined.setdefault(name, []).append(str(path.relative_to(REPO)))
    shared = {name: where for name, where in defined.items() if len(where) > 1}
    assert not shared, shared


def _type_names(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.ClassDef):
        return [node.name]
    is_union = isinstance(getattr(node, "value", None), ast.BinOp) and isinstance(
        node.value.op,  # type: ignore[attr-defined]
        ast.BitOr,
    )
    if isinstance(node, ast.Assign) and is_union:
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and is_union and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []
