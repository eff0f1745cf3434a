"""An OpenAI chat completions body as ``EPDProxy`` sees it: which parts are images, and the
``uuid`` each image is staged under.

vLLM names a multimodal item by the ``uuid`` on its content part, and keys its encoder and
prefix caches by it; the proxy stages each image under a name of its own choosing and sets
it on the part. That name is a function of the image's content, so the same image gets the
same name across requests (vLLM's caches keep working) and a different image never gets
the name of another (vLLM would answer from the other's cached embedding):

- a ``data:`` URI is its content: named at parse time by its text (``content_uuid``);
- any other URL (http(s), ``file://``, a path) names where content was, not what it is:
  the part keeps a provisional random name until the proxy has fetched its bytes through
  the encoder app (under the app's media policy), then ``ChatRequest.name_fetched`` names it
  by their digest (``fetched_uuid``) and rewrites the part's URL to a ``data:`` URI of
  exactly those bytes, so vLLM gets what was encoded. Parts whose URLs give the same bytes
  share one name. A URL the service could not fetch for a failure of its own keeps its URL
  and its random name: vLLM fetches it itself, and caches nothing under a reusable name.

``ChatRequest.rename`` gives a request's images fresh names for a retry, so nothing the
failed attempt left in the engine under the old names (a placeholder from a load that
failed) is reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from typing import Any

from deployments.http_api import parse_json
from registry.errors import InvalidRequest


def content_uuid(vllm_url: str, tensor_parallel_size: int, content: str) -> str:
    """The ``uuid`` of an image part: a function of the vLLM instance, its TP size and the
    image's content, so that the same image always gets the same name there. ``content``
    is a ``data:`` URI's text, or ``"media-digest:<digest>"`` for fetched bytes
    (``fetched_uuid``); the two never collide. A UUID string, which also matches the
    encoder's ``req_id`` pattern."""
    key = f"{vllm_url}|{tensor_parallel_size}|{content}".encode()
    return str(uuid.UUID(bytes=hashlib.blake2b(key, digest_size=16).digest()))


def fetched_uuid(vllm_url: str, tensor_parallel_size: int, digest: str) -> str:
    """The ``uuid`` of an image fetched from a URL: of its bytes' ``media_digest`` (what the
    encoder app's ``fetch_media`` answers), not of the URL."""
    return content_uuid(vllm_url, tensor_parallel_size, f"media-digest:{digest}")


def is_data_uri(url: str) -> bool:
    return url[:5].lower() == "data:"


@dataclasses.dataclass(slots=True)
class ChatRequest:
    """A parsed chat body with ``uuid`` set on its image parts, and what to encode per uuid."""

    body: dict[str, Any]
    items: dict[str, dict[str, Any]]  # uuid -> our one-item encode item (images whose content is known)
    where: dict[str, str]  # uuid -> the first part carrying it, for error messages (every image)
    parts: dict[str, list[dict[str, Any]]]  # uuid -> the body's parts carrying it (every image)
    urls: dict[str, str] = dataclasses.field(default_factory=dict)  # provisional uuid -> URL, until fetched

    @property
    def req_ids(self) -> list[str]:
        return list(self.items)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def name_fetched(self, name: str, part_uuid: str, data_uri: str, item: dict[str, Any]) -> None:
        """The URL image provisionally named ``name`` was fetched: its parts now carry
        ``part_uuid`` (``fetched_uuid``) and ``data_uri`` (of the fetched bytes), and ``item``
        (those bytes) is what to encode under ``part_uuid``. URLs with the same bytes merge."""
        del self.urls[name]
        parts, where = self.parts.pop(name), self.where.pop(name)
        for part in parts:
            part["uuid"] = part_uuid
            part["image_url"]["url"] = data_uri
        if part_uuid not in self.parts:
            self.items[part_uuid] = item
            self.where[part_uuid] = where
            self.parts[part_uuid] = []
        self.parts[part_uuid].extend(parts)

    def rename(self) -> dict[str, str]:
        """Name every image afresh (random UUIDs), in the body too; returns old -> new."""
        renamed = {old: str(uuid.uuid4()) for old in self.parts}
        for old, new in renamed.items():
            for part in self.parts[old]:
                part["uuid"] = new
        self.items = {renamed[old]: item for old, item in self.items.items()}
        self.where = {renamed[old]: at for old, at in self.where.items()}
        self.parts = {renamed[old]: parts for old, parts in self.parts.items()}
        self.urls = {renamed[old]: url for old, url in self.urls.items()}
        return renamed

    def encoded_body(self) -> bytes:
        return json.dumps(self.body).encode()


def parse_chat_request(raw: bytes, vllm_url: str, tensor_parallel_size: int) -> ChatRequest:
    """Parse a chat completions body and name its image parts (sets ``part["uuid"]``): a
    ``data:`` URI by its content, any other URL provisionally (``ChatRequest.urls``; the
    same URL twice in one request: one name) until ``ChatRequest.name_fetched``.

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
    provisional: dict[str, str] = {}  # URL -> its provisional name
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
            data = is_data_uri(url)
            if data:
                part_uuid = content_uuid(vllm_url, tensor_parallel_size, url)
            else:  # random until its bytes are known: no name of a URL outlives this request
                part_uuid = provisional.setdefault(url, str(uuid.uuid4()))
            # A client's own uuid is replaced: only ours names something staged.
            part["uuid"] = part_uuid
            if part_uuid not in chat.parts:
                if data:
                    chat.items[part_uuid] = {"type": "image_url", "image_url": {"url": url}}
                else:
                    chat.urls[part_uuid] = url
                chat.where[part_uuid] = at
                chat.parts[part_uuid] = []
            chat.parts[part_uuid].append(part)
    return chat
