"""Markers from folders: tests/unit -> unit, tests/integration -> integration, tests/e2e -> e2e."""

import pathlib

import pytest

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = pathlib.Path(str(item.fspath)).relative_to(_HERE).parts[0]
        if folder in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, folder))
