"""The log line of each kind of error, and Serve's traceback line dropped for our errors."""

import logging

from registry.errors import EncodeFailed, InvalidRequest, NotReady, Overloaded
from registry.logs import RateLimited, log_error, quiet_client_errors


def test_each_error_is_one_line_with_req_id_code_and_unmasked_cause(caplog):
    logger = logging.getLogger("ray.serve.tests")
    with caplog.at_level(logging.DEBUG, logger="ray.serve.tests"):
        log_error(logger, InvalidRequest("items[0]: the image data is corrupt", "r1"))
        log_error(logger, NotReady("req_id r2 was not staged within 5s", "r2"))
        log_error(logger, EncodeFailed("items[0]: RuntimeError: CUDA out of memory", "r3"))
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("INFO", "request refused: req_id=r1 code=invalid_request: items[0]: the image data is corrupt"),
        ("WARNING", "request failed: req_id=r2 code=not_ready: req_id r2 was not staged within 5s"),
        ("ERROR", "request failed: req_id=r3 code=encode_failed: items[0]: RuntimeError: CUDA out of memory"),
    ]
    assert all(r.exc_info is None for r in caplog.records)  # no tracebacks


def test_serve_s_traceback_line_is_dropped_for_our_errors_and_kept_for_bugs(caplog):
    quiet_client_errors()
    serve_logger = logging.getLogger("ray.serve")
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for exc in (InvalidRequest("bad", "r1"), EncodeFailed("boom", "r2"), KeyError("a bug")):
            try:
                raise exc
            except Exception:
                serve_logger.exception("Request failed.")
    assert [r.exc_info[1] for r in caplog.records if r.name == "ray.serve"] == [caplog.records[-1].exc_info[1]]
    assert isinstance(caplog.records[-1].exc_info[1], KeyError)


def test_a_flood_is_rate_limited_with_the_count_it_stands_for(caplog):
    logger = logging.getLogger("ray.serve.tests.flood")
    limited = RateLimited(logger, period_s=3600)
    with caplog.at_level(logging.WARNING, logger="ray.serve.tests.flood"):
        for i in range(100):
            limited.log(logging.WARNING, "overloaded", "request refused: %s", Overloaded("full", f"r{i}"))
    assert len(caplog.records) == 1
    limited._last["overloaded"] -= 7200  # the period has passed
    with caplog.at_level(logging.WARNING, logger="ray.serve.tests.flood"):
        limited.log(logging.WARNING, "overloaded", "request refused: %s", "again")
    assert "and 99 more like it" in caplog.records[-1].getMessage()
