"""Markers from folders: tests/unit -> unit, tests/integration -> integration, tests/e2e -> e2e.

Every Ray cluster the tests start, in this process or a child (``serve run``, the benchmark),
gives Serve's HTTP proxy the time a loaded 2-core machine needs to start it."""

import pathlib

import pytest

from benchmarks.cluster import slow_machine_env

slow_machine_env()

_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = pathlib.Path(str(item.fspath)).relative_to(_HERE).parts[0]
        if folder in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, folder))
