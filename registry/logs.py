"""Logging under Ray Serve's conventions, for every component of the service.

Loggers are children of ``ray.serve`` (``get_logger(__name__)`` -> ``ray.serve.<module>``),
as Ray Serve LLM names its own: inside a replica they write through the handlers Serve
set up from the app's ``logging_config`` (level, ``encoding: JSON``, the replica's log
file), with the replica's request id on each line. The registry actor is no replica, so
``configure_actor_logging`` gives it a stream handler (its Ray worker log) in Serve's
text layout.

Every line about a request names its ``req_id``, and an error line its code and cause.
Each ``RegistryError`` is logged once, by the component that knows its req_id (the
registry for what reaches it, the Ingress and the proxy for what they refuse
themselves): a client's mistake at INFO without a traceback, our failures at WARNING
or ERROR with the unmasked cause. So ``quiet_client_errors`` drops Serve's own
"Request failed." ERROR line with a traceback, which Serve writes for every exception
a replica method raises, when that exception is a ``RegistryError``; any other
exception (a bug, a model crash) keeps its traceback.
"""

from __future__ import annotations

import logging
import time

from registry.errors import RegistryError, http_status, unwrap

_SERVE_LOGGER = "ray.serve"
_TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s %(process)d -- %(message)s"


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name``, under Serve's (``ray.serve.<name>``)."""
    return logging.getLogger(f"{_SERVE_LOGGER}.{name}")


def error_fields(error: RegistryError) -> str:
    """``req_id=... code=... cause`` for a log line (the unmasked message)."""
    return f"req_id={error.req_id} code={error.code}: {error.message}"


def log_error(logger: logging.Logger, error: RegistryError) -> None:
    """The one line about ``error``: INFO for a client's mistake, WARNING when the service is
    busy or a part of it is unreachable, ERROR for a failure of ours."""
    status = http_status(error)
    if status < 500 and error.code != "overloaded":
        logger.info("request refused: %s", error_fields(error))
    elif status < 500 or error.code in ("not_ready", "unavailable"):
        logger.warning("request failed: %s", error_fields(error))
    else:
        logger.error("request failed: %s", error_fields(error))


class _LoggedElsewhere(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and isinstance(unwrap(exc), RegistryError))


_FILTER = _LoggedElsewhere()


def quiet_client_errors() -> None:
    """In this replica, drop Serve's traceback line for a ``RegistryError`` (logged once
    already, with its req_id). Idempotent; Serve's later logging reconfigurations keep it
    (it sits on the logger, not on a handler)."""
    logger = logging.getLogger(_SERVE_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def configure_actor_logging(level: int | str = logging.INFO) -> None:
    """Log this (non-replica) actor's ``ray.serve.*`` lines to its Ray worker log."""
    logger = logging.getLogger(_SERVE_LOGGER)
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_TEXT_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class RateLimited:
    """At most one line per ``period_s`` for a kind of event, with the count it stands for,
    so a flood (of overload refusals, say) does not flood the log."""

    def __init__(self, logger: logging.Logger, period_s: float = 5.0):
        self._logger, self._period_s = logger, period_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self._period_s) < self._period_s:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        suffix = f" (and {skipped} more like it since the last line)" if skipped else ""
        self._logger.log(level, message + suffix, *args)
