"""An OpenAI chat completions body as ``EPDProxy`` sees it: which parts are images, and the
``uuid`` each image is staged under.

vLLM names a multimodal item by the ``uuid`` on its content part; the proxy stages each
image under a name of its own choosing and sets it on the part. ``content_uuid`` makes
that name a function of the image, so the same image gets the same name across requests
(vLLM's prefix and encoder caches keep working); ``ChatRequest.rename`` gives a request's
images fresh names for a retry, so nothing the failed attempt left in the engine under
the old names (a placeholder from a load that failed) is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from typing import Any

from deployments.http_api import parse_json
from registry.errors import InvalidRequest


def content_uuid(vllm_url: str, tensor_parallel_size: int, url: str) -> str:
    """The ``uuid`` of an image part: a function of the vLLM instance, its TP size and the
    image URL or data URI, so that the same image always gets the same name there.
    A UUID string, which also matches the encoder's ``req_id`` pattern."""
    key = f"{vllm_url}|{tensor_parallel_size}|{url}".encode()
    return str(uuid.UUID(bytes=hashlib.blake2b(key, digest_size=16).digest()))


@dataclasses.dataclass(slots=True)
class ChatRequest:
    """A parsed chat body with ``uuid`` set on its image parts, and what to encode per uuid."""

    body: dict[str, Any]
    items: dict[str, dict[str, Any]]  # uuid -> our one-item encode item
    where: dict[str, str]  # uuid -> the first part carrying it, for error messages
    parts: dict[str, list[dict[str, Any]]]  # uuid -> the body's parts carrying it

    @property
    def req_ids(self) -> list[str]:
        return list(self.items)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def rename(self) -> dict[str, str]:
        """Name every image afresh (random UUIDs), in the body too; returns old -> new."""
        renamed = {old: str(uuid.uuid4()) for old in self.items}
        for old, new in renamed.items():
            for part in self.parts[old]:
                part["uuid"] = new
        self.items = {renamed[old]: item for old, item in self.items.items()}
        self.where = {renamed[old]: at for old, at in self.where.items()}
        self.parts = {renamed[old]: parts for old, parts in self.parts.items()}
        return renamed

    def encoded_body(self) -> bytes:
        return json.dumps(self.body).encode()


def parse_chat_request(raw: bytes, vllm_url: str, tensor_parallel_size: int) -> ChatRequest:
    """Parse a chat completions body and name its image parts (sets ``part["uuid"]``).

    Raises:
        InvalidRequest: not JSON, nested too deeply, not an object, ``messages`` not a
            list, a message or content part not an object, an ``image_url`` part
            without a string ``image_url.url``.
    """
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest('"messages" must be a list of message objects')
    chat = ChatRequest(body=body, items={}, where={}, parts={})
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object, got {type(message).__name__}")
        content = message.get("content")
        if not isinstance(content, list):  # a string, or absent: nothing to stage
            continue
        for j, part in enumerate(content):
            at = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict):
                raise InvalidRequest(f"{at} must be an object, got {type(part).__name__}")
            if part.get("type") != "image_url":
                continue
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise InvalidRequest(f'{at}: an "image_url" part needs "image_url": {{"url": "..."}}')
            part_uuid = content_uuid(vllm_url, tensor_parallel_size, url)
            # A client's own uuid is replaced: only ours names something staged.
            part["uuid"] = part_uuid
            if part_uuid not in chat.items:
                chat.items[part_uuid] = {"type": "image_url", "image_url": {"url": url}}
                chat.where[part_uuid] = at
                chat.parts[part_uuid] = []
            chat.parts[part_uuid].append(part)
    return chat
