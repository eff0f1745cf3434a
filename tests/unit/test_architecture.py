"""docs/architecture.md tells one request's path by file and function: every name it gives
must exist, and the path must stay short enough to tell."""

import importlib
import pathlib
import re

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_PAGE = _ROOT / "docs" / "architecture.md"
# `path/to/module.py::Name` or `path/to/module.py::Class.method`
_NAMED = re.compile(r"`([\w/]+)\.py::([\w.]+)`")


def _named() -> list[tuple[str, str]]:
    return _NAMED.findall(_PAGE.read_text())


def test_every_function_the_architecture_page_names_exists():
    named = _named()
    assert len(named) >= 15, named  # the page names its hops by function
    missing = []
    for path, dotted in named:
        assert (_ROOT / f"{path}.py").is_file(), f"{path}.py"
        target = importlib.import_module(path.replace("/", "."))
        for part in dotted.split("."):
            target = getattr(target, "func_or_class", target)  # a Serve deployment: its class
            target = getattr(target, part, None)
            if target is None:
                missing.append(f"{path}.py::{dotted}")
                break
    assert missing == []


def test_the_request_path_takes_five_hops_or_fewer():
    hops = re.findall(r"^\*\*(\d+)\. ", _PAGE.read_text(), flags=re.MULTILINE)
    assert hops == [str(n) for n in range(1, len(hops) + 1)] and 3 <= len(hops) <= 5, hops
