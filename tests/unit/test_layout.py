"""Sizes that keep the project readable: no Python file over 400 lines, tests included, and
``benchmarks/`` at 2,000 lines or fewer (the harnesses share one lifecycle and one report)."""

import pathlib
import subprocess

_ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_BENCHMARK_LINES = 2000


def _python_files() -> dict[str, int]:
    """Lines of every Python file git tracks or would add (ignored files, such as the venv, aside)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=_ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return {name: len((_ROOT / name).read_text().splitlines()) for name in listed if (_ROOT / name).is_file()}


def test_no_python_file_is_over_400_lines():
    files = _python_files()
    assert len(files) > 100 and "registry/server/actor.py" in files  # the listing found the project
    assert {name: lines for name, lines in files.items() if lines > MAX_FILE_LINES} == {}


def test_benchmarks_stay_within_2000_lines():
    lines = sum(n for name, n in _python_files().items() if name.startswith("benchmarks/"))
    assert 0 < lines <= MAX_BENCHMARK_LINES, f"benchmarks/ has {lines} lines"
