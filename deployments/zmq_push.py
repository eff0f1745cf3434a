"""Pushing a request's items to a decoder rank outside Ray over ZMQ.

A rank's ``registry.client.zmq_receiver.ZmqEmbeddingReceiver`` binds a PULL socket and
registers its endpoint with ``POST /v1/requests/{req_id}/push``; the Ingress
replica that takes the call connects a PUSH socket to it (one per endpoint,
kept) and sends each item as a two-frame message:

1. a JSON header: ``{"req_id", "delivery", "index", "count", "meta"}``;
2. the item's raw bytes, handed to ZMQ without a copy into a Python bytes object
   (for items past pyzmq's copy threshold, 64 KiB).

``delivery`` names one registration, so a receiver drops frames of an earlier,
abandoned one. The endpoint comes from the client, so it is checked before
anything connects to it: ``tcp://`` with an IP literal (no name lookup, so no DNS
rebinding) inside ``push_allowed_networks`` and a port.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from registry.errors import InvalidRequest, Unavailable

# Most PUSH sockets one replica keeps open (one per receiver endpoint), least recently used closed first.
MAX_SOCKETS = 256
# How long one push may wait for its receiver's connection and queue before it is abandoned.
SEND_TIMEOUT_S = 10.0

_ENDPOINT = re.compile(r"tcp://(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<v4>[0-9.]+)):(?P<port>[0-9]{1,5})")


def check_endpoint(endpoint: Any, allowed: list[ipaddress.IPv4Network | ipaddress.IPv6Network], req_id: str) -> str:
    """``endpoint`` as the service will connect to it, if the policy allows it; else ``invalid_request``."""
    match = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    if match is None:
        raise InvalidRequest(
            f"endpoint must be tcp://<IP address>:<port> (an IPv6 address in brackets), got {endpoint!r}", req_id
        )
    try:
        address = ipaddress.ip_address(match["v4"] or match["v6"])
    except ValueError:
        raise InvalidRequest(f"endpoint {endpoint!r} does not hold a valid IP address", req_id) from None
    if not 1 <= int(match["port"]) <= 65535:
        raise InvalidRequest(f"endpoint {endpoint!r}: the port must be between 1 and 65535", req_id)
    if not any(address in network for network in allowed):
        raise InvalidRequest(
            f"endpoint {endpoint!r} is outside push_allowed_networks "
            f"({', '.join(map(str, allowed)) or 'none'}); the service pushes only to addresses it is configured for",
            req_id,
        )
    return endpoint


def frames(req_id: str, delivery: str, items: list[tuple[dict[str, Any], np.ndarray]]) -> list[list[Any]]:
    """The messages of one delivery: header and raw bytes per item."""
    count = len(items)
    return [
        [
            json.dumps({"req_id": req_id, "delivery": delivery, "index": i, "count": count, "meta": meta}).encode(),
            memoryview(np.ascontiguousarray(payload)).cast("B"),
        ]
        for i, (meta, payload) in enumerate(items)
    ]


class ZmqPusher:
    """The replica's PUSH sockets, by endpoint. Used from one event loop."""

    def __init__(self) -> None:
        self._context: zmq.asyncio.Context | None = None
        self._sockets: OrderedDict[str, zmq.asyncio.Socket] = OrderedDict()

    def _socket(self, endpoint: str) -> zmq.asyncio.Socket:
        socket = self._sockets.pop(endpoint, None)
        if socket is None:
            if self._context is None:
                self._context = zmq.asyncio.Context()
            socket = self._context.socket(zmq.PUSH)
            # Queue only to a completed connection: a send to a receiver that is not there waits
            # (and times out) instead of filling a queue for nobody. Never linger on close.
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            while len(self._sockets) >= MAX_SOCKETS:
                self._sockets.popitem(last=False)[1].close()
        self._sockets[endpoint] = socket
        return socket

    async def push(self, endpoint: str, messages: list[list[Any]], req_id: str) -> None:
        """Send ``messages`` to ``endpoint``; ``unavailable`` if it does not take them in time."""
        socket = self._socket(endpoint)
        try:
            async with asyncio.timeout(SEND_TIMEOUT_S):
                for message in messages:
                    await socket.send_multipart(message, copy=False)
        except TimeoutError:
            # A half-sent delivery must not reach a receiver that connects later: drop the socket.
            self._sockets.pop(endpoint, None)
            socket.close()
            raise Unavailable(
                f"could not push to {endpoint} within {SEND_TIMEOUT_S:.0f}s: is the receiver's PULL socket bound "
                "there and reachable from the encoder service?",
                req_id,
            ) from None
