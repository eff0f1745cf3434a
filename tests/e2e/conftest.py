"""One ``serve run serve_config.yaml`` for the e2e tests that use the default config."""

import pytest

from serve_run import serve_run


@pytest.fixture(scope="session")
def service(tmp_path_factory):
    with serve_run(tmp_path_factory.mktemp("serve") / "serve_run.log") as proc:
        yield proc
