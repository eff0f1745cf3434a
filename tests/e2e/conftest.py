"""One ``serve run serve_config.yaml`` for the e2e tests that use the default config, and the
engines' own venvs built in the background from the start of the session.

Building a side venv (``tests/side_venvs.py``) takes minutes, mostly pip waiting on
downloads and disk; built inside the first test that needs it, that time would count
against the test's timeout and hold up everything after it. So when the session has
selected a test that needs one, a thread starts building it at once; the test's fixture
then finds it built, or waits on the build's file lock. A failed build is remembered
(``side_venvs``), and the fixture skips with its message as before.

The ``serve run`` ends after the last test that uses it, not with the session: left running,
its idle cluster (controller, proxy, replicas, dashboard) would take CPU from every test after.
"""

import contextlib
import threading

import pytest

import sglang_env
import vllm_cpu_env
from serve_run import serve_run

# Test modules by the venv they need, and how to build it.
_VENVS = {
    ("test_vllm_engine", "test_vllm_fidelity", "test_vllm_stack", "test_vllm_ttft_benchmark"): vllm_cpu_env.ensure_vllm_cpu_python,
    ("test_sglang",): sglang_env.ensure_sglang_python,
}


# The shared ``serve run`` (entered by ``service``) and the last selected test that uses it.
_SERVICE = contextlib.ExitStack()
_LAST_USER: list[str] = []


def pytest_collection_finish(session):
    _LAST_USER[:] = [item.nodeid for item in session.items if "service" in item.fixturenames][-1:]
    modules = {item.module.__name__.rsplit(".", 1)[-1] for item in session.items if item.module is not None}
    for users, ensure in _VENVS.items():
        if modules & set(users):
            threading.Thread(target=_build, args=(ensure,), name=f"build-{ensure.__name__}", daemon=True).start()


def _build(ensure) -> None:
    try:
        ensure()
    except Exception:  # noqa: BLE001 - remembered by side_venvs; the fixture reports it
        pass


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    with _SERVICE:
        yield _SERVICE.enter_context(serve_run(tmp_path_factory.mktemp("serve") / "serve_run.log"))


@pytest.fixture(autouse=True)
def _end_service_after_its_last_user(request):
    yield
    if request.node.nodeid in _LAST_USER:
        _SERVICE.close()
