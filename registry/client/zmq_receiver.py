"""A TP rank outside Ray receiving its embeddings over ZMQ.

::

    from registry.client.zmq_receiver import ZmqEmbeddingReceiver

    rx = ZmqEmbeddingReceiver(rank=r, url="http://127.0.0.1:8000", bind="tcp://127.0.0.1:0")
    items = rx.fetch(req_id, timeout_s=30.0)      # [ReceivedItem(tensor, meta), ...] in item order
    rx.acknowledge(other_req_id)                  # already held: count this rank, read nothing

Needs pyzmq, numpy and torch; never Ray (the process need not join the cluster).
``fetch`` registers this rank's bound PULL socket with the service
(``POST /v1/requests/{req_id}/push``, which waits while the request is pending),
receives one two-frame message per item (JSON header, raw bytes; see
``deployments.zmq_push``) and only then acknowledges receipt
(``POST /v1/requests/{req_id}/acknowledge``), which is when the registry counts
this rank. A push that does not arrive is registered again until ``timeout_s``;
it never counted. Tensors are views of the received frames (bfloat16 kept), no
further copy. Errors are the service's ``registry.errors.RegistryError`` subclasses
with their codes, as ``EmbeddingReceiver`` raises them.

One ``fetch`` at a time per receiver: it is not thread-safe.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from typing import Any

import zmq

from registry.checks import check_rank, check_seconds
from registry.errors import ERRORS_BY_CODE, InvalidRequest, NotReady, RegistryError, Unavailable
from registry.client.received_item import ReceivedItem, item_from_buffer
from registry.settings import api_token_from_env

# How long a registered push may go without a message arriving before it is registered again.
_ARRIVAL_S = 5.0
# Seconds on top of a call's own wait for the HTTP answer.
_HTTP_GRACE_S = 10.0


def _error_from(status: int, body: bytes, req_id: str) -> RegistryError:
    """The service's error body as its exception; a body that is not one (a proxy's page) as ``unavailable``."""
    try:
        error = json.loads(body)["error"]
        return ERRORS_BY_CODE[error["code"]](error["message"], error.get("req_id", req_id), error.get("details"))
    except (ValueError, KeyError, TypeError):
        return Unavailable(f"the encoder service answered HTTP {status} without an error body", req_id)


class ZmqEmbeddingReceiver:
    """Receives staged embeddings for one TP rank over ZMQ, without Ray.

    ``rank``: this process's rank (below the request's ``receive_count``). ``url``: the
    encoder service's HTTP address. ``bind``: where this rank's PULL socket listens
    (port 0: any free one). ``advertise``: this host's IP address for the service to push
    to (with the bound port), when ``bind`` is a wildcard (``tcp://0.0.0.0:0``). ``api_token``:
    the service's bearer token (default ``EPD_API_TOKEN``).
    """

    def __init__(
        self,
        rank: int,
        url: str = "http://127.0.0.1:8000",
        bind: str = "tcp://127.0.0.1:0",
        *,
        advertise: str | None = None,
        api_token: str | None = None,
    ):
        self.rank = check_rank(rank)
        self._url = url.rstrip("/")
        parts = urllib.parse.urlsplit(self._url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port][/prefix], got {url!r}")
        self._scheme, self._host, self._port, self._prefix = parts.scheme, parts.hostname, parts.port, parts.path
        self._http: http.client.HTTPConnection | None = None
        self._token = api_token or api_token_from_env()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port, when bind said 0
        port = bound.rsplit(":", 1)[1]
        if advertise is not None:
            bound = f"tcp://[{advertise}]:{port}" if ":" in advertise else f"tcp://{advertise}:{port}"
        elif "://0.0.0.0:" in bound or "://[::]:" in bound:
            self.close()
            raise ValueError(f"bound to {bound}: pass advertise='<this host's IP address>' for the service to push to")
        #: Where the service pushes to: ``tcp://<IP>:<port>``.
        self.endpoint = bound

    def fetch(self, req_id: str, timeout_s: float = 30.0) -> list[ReceivedItem]:
        """This rank's items of ``req_id``, in order, once staged (waits up to ``timeout_s``);
        counted as this rank's fetch once they arrived."""
        check_seconds(timeout_s, lambda message: InvalidRequest(message, req_id))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            # A rank's fetch races its encode: wait for a req_id not submitted yet, as a Ray rank's does.
            pushed = self._post(req_id, "push", {"rank": self.rank, "endpoint": self.endpoint, "timeout_s": remaining,
                                                 "wait_for_submit": True})
            items = self._collect(req_id, pushed["delivery"], pushed["items"])
            if items is not None:
                self._post(req_id, "acknowledge", {"rank": self.rank, "transport": "zmq"})
                return items
            if time.monotonic() >= deadline:
                raise NotReady(
                    f"the items of req_id {req_id} were pushed to {self.endpoint} but did not arrive within {timeout_s}s; "
                    "is that address reachable from the encoder service?",
                    req_id,
                )

    def acknowledge(self, req_id: str, timeout_s: float = 0.0) -> bool:
        """Count this rank as a receiver of ``req_id`` without receiving it (it holds the items
        already). Same rules and errors as ``fetch``. True if this released the entry."""
        answer = self._post(req_id, "acknowledge", {"rank": self.rank, "transport": "zmq", "timeout_s": timeout_s})
        return bool(answer["released"])

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        self._socket.close()
        self._context.term()

    def __enter__(self) -> ZmqEmbeddingReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _collect(self, req_id: str, delivery: str, count: int) -> list[ReceivedItem] | None:
        """The ``count`` items of ``delivery`` as they arrive; None if ``_ARRIVAL_S`` pass
        without one. Messages of other deliveries (an earlier attempt's) are dropped."""
        items: dict[int, ReceivedItem] = {}
        deadline = time.monotonic() + _ARRIVAL_S
        while len(items) < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._socket.poll(remaining_ms, zmq.POLLIN):
                return None
            frames = self._socket.recv_multipart(copy=False)
            # Anything may connect to a bound socket: what is not an item of this delivery is dropped.
            try:
                header_frame, data = frames
                header = json.loads(header_frame.bytes)
                if header["delivery"] != delivery or header["req_id"] != req_id or header["index"] not in range(count):
                    continue
                items[header["index"]] = item_from_buffer(data.buffer, header["meta"])
            except (ValueError, KeyError, TypeError):
                continue
            deadline = time.monotonic() + _ARRIVAL_S  # still arriving: a large delivery may take a while
        return [items[i] for i in range(count)]

    def _post(self, req_id: str, action: str, body: dict[str, Any]) -> dict[str, Any]:
        path = f"{self._prefix}/v1/requests/{urllib.parse.quote(req_id, safe='')}/{action}"
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        timeout = body.get("timeout_s", 0.0) + _HTTP_GRACE_S
        for attempt in range(2):
            connection = self._connection(timeout)
            try:
                connection.request("POST", path, json.dumps(body).encode(), headers)
                answer = connection.getresponse()
                data = answer.read()
                break
            except (http.client.HTTPException, OSError) as exc:
                connection.close()
                self._http = None
                # A kept-alive connection the server closed meanwhile: once more on a new one
                # (both calls are safe to repeat: neither counts a rank twice).
                if attempt == 0 and isinstance(exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                raise Unavailable(f"the encoder service at {self._url} is not reachable ({exc}); retry shortly", req_id) from None
        if answer.status >= 400:
            raise _error_from(answer.status, data, req_id)
        return json.loads(data)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        """The kept-alive connection to the service (made on first use, or again after a failure)."""
        if self._http is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._http = kind(self._host, self._port, timeout=timeout)
        self._http.timeout = timeout
        if self._http.sock is not None:
            self._http.sock.settimeout(timeout)
        return self._http
