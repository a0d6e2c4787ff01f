"""``--version`` from a source tree that was never installed still answers (issue 34)."""

from __future__ import annotations

import importlib.metadata

import pytest

from broker.ops.cli import options


def test_an_uninstalled_checkout_says_its_version_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert options.version() == "(unknown: the broker-jobs distribution is not installed)"
