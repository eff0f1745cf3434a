"""Logging under Ray Serve's conventions, for every component of the service.

Loggers are children of ``ray.serve`` (``get_logger(__name__)`` -> ``ray.serve.<module>``),
as Ray Serve LLM names its own: inside a replica they write through the handlers Serve
set up from the app's ``logging_config`` (level, ``encoding: JSON``, the replica's log
file), with the replica's request id on each line. The registry actor is no replica, so
``configure_actor_logging`` gives it a stream handler (its Ray worker log) at the level
and in the encoding (Serve's text layout or JSON) of the Ingress that configured it last.

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

import json
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


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, with the keys Serve's JSON lines use for the same fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "asctime": self.formatTime(record), "levelname": record.levelname, "name": record.name,
            "process": record.process, "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc_text"] = self.formatException(record.exc_info)
        return json.dumps(out)


_ACTOR_HANDLER: logging.Handler | None = None


def configure_actor_logging(level: int | str = logging.INFO, encoding: str = "TEXT") -> None:
    """Log this (non-replica) actor's ``ray.serve.*`` lines to its Ray worker log, at
    ``level``, as Serve's text layout or (``encoding="JSON"``) one JSON object a line.
    Called again, it changes the level and layout of the same handler."""
    global _ACTOR_HANDLER
    # Importing Serve replaces this logger's handlers with its default one (once per
    # process), so let that happen first, then take the logger over.
    import ray.serve  # noqa: F401

    logger = logging.getLogger(_SERVE_LOGGER)
    if _ACTOR_HANDLER is None:
        _ACTOR_HANDLER = logging.StreamHandler()
    for handler in list(logger.handlers):
        if handler is not _ACTOR_HANDLER:
            logger.removeHandler(handler)
    if _ACTOR_HANDLER not in logger.handlers:
        logger.addHandler(_ACTOR_HANDLER)
    logger.propagate = False
    _ACTOR_HANDLER.setFormatter(_JsonFormatter() if encoding.upper() == "JSON" else logging.Formatter(_TEXT_FORMAT))
    logger.setLevel(level)


def replica_log_format() -> tuple[int, str]:
    """(level, ``"JSON"`` or ``"TEXT"``) of this replica's logging, as Serve set it up from
    the app's ``logging_config``: what the registry actor should log with too."""
    logger = logging.getLogger(_SERVE_LOGGER)
    # Serve buffers its file handler behind a MemoryHandler (``target``); the formatter is
    # matched by class name because Serve's JSON formatter lives in a private Ray module.
    formatters = [getattr(getattr(h, "target", None) or h, "formatter", None) for h in logger.handlers]
    json_used = any(type(f).__name__ == "JSONFormatter" for f in formatters)
    return logger.level or logging.INFO, "JSON" if json_used else "TEXT"


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
