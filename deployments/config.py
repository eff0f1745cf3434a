"""The configuration: one pydantic model per app's ``args`` (``AppConfig``; ``ProxyConfig`` for the proxy).

Every field has a default and a description; a bad value fails ``serve run``
with a message naming the field. Python::

    from deployments import build_app
    serve.run(build_app({"ttl_s": 60, "default_receive_count": 2}), name="epd")

YAML (``serve_config.yaml``)::

    applications:
      - name: epd
        route_prefix: /
        import_path: deployments.app:build_app
        args:
          registry_name: epd_registry
          registry_namespace: epd
          default_receive_count: 1
          ttl_s: 180
          model: {family: qwen2_5_vl, dtype: auto, device: auto}

Per-deployment Serve settings (replicas, GPUs, batching through ``user_config``)
live in the config file's ``deployments:`` list, not here.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from encoder import DTYPES, FAMILIES, EncoderSpec, MediaError, MediaPolicy
from registry import DEFAULT_REGISTRY_NAME, DEFAULT_REGISTRY_NAMESPACE, Limits, RegistrySettings

_MiB = 1024 * 1024


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str = Field(
        "qwen2_5_vl", description=f"Model family, one of {FAMILIES}; without path, its tiny seeded model."
    )
    path: str | None = Field(
        None,
        description="Local Hugging Face model directory (full multimodal model or vision tower only); "
        "absent: the family's tiny seeded model, built from a config.",
    )
    dtype: Literal["auto", *DTYPES] = Field(  # type: ignore[valid-type]
        "auto", description='Compute and staging dtype; "auto" is bfloat16 on CUDA, float32 on CPU.'
    )
    device: str = Field("auto", description='"auto" (CUDA when the replica has a GPU, else CPU), "cpu" or "cuda".')
    options: dict[str, Any] = Field(
        default_factory=dict, description="Family-specific settings (see docs/models.md)."
    )

    @model_validator(mode="after")
    def _known_family(self) -> "ModelConfig":
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; choose one of {list(FAMILIES)}")
        return self

    def to_spec(self) -> EncoderSpec:
        return EncoderSpec(
            family=self.family, path=self.path, dtype=self.dtype, device=self.device, options=dict(self.options)
        )


class BatchConfig(BaseModel):
    """The Encoder deployment's ``user_config``: dynamic batching, changeable live."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(8, ge=1, le=512, description="Most items one forward pass takes.")
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, le=10, description="Longest wait for a batch to fill before running it anyway."
    )


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    registry_name: str = Field(DEFAULT_REGISTRY_NAME, min_length=1, description="Name of the registry actor.")
    registry_namespace: str = Field(
        DEFAULT_REGISTRY_NAMESPACE, min_length=1, description="Ray namespace of the registry actor."
    )
    default_receive_count: int = Field(
        1, ge=1, description="TP ranks that must fetch an entry before it is released, when a request does not say."
    )
    max_receive_count: int = Field(64, ge=1, le=4096, description="Largest receive_count a request may ask for.")
    ttl_s: float = Field(180.0, gt=0, description="Seconds a staged entry waits for all its ranks before it expires.")
    encode_timeout_s: float = Field(120.0, gt=0, description="Seconds an entry may stay pending before it expires.")
    http_pull_grace_s: float = Field(
        10.0, ge=0, le=600,
        description="A rank that pulls its items over HTTP is counted when it acknowledges them, or this many seconds "
        "after its last pull if it does not; until then a pull again (after a dropped connection) gets them again.",
    )
    tombstone_ttl_s: float = Field(600.0, ge=0, description="Seconds an ended entry is remembered for late callers.")
    max_tombstones: int = Field(10_000, ge=0, description="Most ended entries remembered (oldest dropped first).")
    max_pending_requests: int = Field(
        4096, ge=1, description="Requests being encoded at once; past it new ones get overloaded (429)."
    )
    max_staged_bytes: int = Field(
        8 * 1024**3, ge=1, description="Bytes of staged embeddings entries may hold; past it new requests get 429."
    )
    max_pending_input_bytes: int = Field(
        2 * 1024**3, ge=1,
        description="Bytes of media the requests being encoded may hold (their inputs stay in the object store until "
        "their encode ends); past it new requests get 429.",
    )
    max_object_store_fraction: float = Field(
        0.5, gt=0, le=0.9,
        description="Also cap staged bytes at this share of the cluster's object store, so it never fills with them.",
    )
    registry_max_concurrency: int = Field(
        10_000, ge=16, description="Concurrent calls the registry accepts; each waiting fetch holds one."
    )
    registry_shards: int = Field(
        1, ge=1, le=64,
        description="Registry actors; each req_id belongs to one by a stable hash. Admission limits, tombstones "
        "and the cache are split evenly among them. Fixed when the registry is created.",
    )
    registry_call_timeout_s: float = Field(
        30.0, gt=0, le=600,
        description="Seconds the registry may take to answer an Ingress call, beyond any wait the call asks for; past "
        "them the call is cancelled and its client gets 503 unavailable.",
    )
    registry_niceness: int | None = Field(
        0, ge=-20, le=19,
        description="CPU niceness of the registry actors (Linux; lowering it needs CAP_SYS_NICE). Ray starts workers "
        "at 15, and a CPU-bound engine on the same node then starves the hand-off; null keeps Ray's.",
    )
    cache_max_bytes: int = Field(
        512 * _MiB, ge=0, description="Bytes of embeddings the content-hash cache keeps for reuse; 0 turns it off."
    )
    encoder_call_max_items: int = Field(
        8, ge=1, le=64,
        description="Most items the registry sends in one Encoder call: items that reach it together (a busy "
        "registry's) share a call, each result still its own object. 1: one call per item.",
    )
    registry_call_max_requests: int = Field(
        64, ge=1, le=1024,
        description="Most wait=false encode requests an Ingress replica hands the registry in one call: those that "
        "reach it together share a call. 1: one call per request.",
    )
    max_waiting_requests: int = Field(
        256, ge=1,
        description="Requests an Ingress replica lets wait at once (a describe with wait_s, an HTTP pull, a ZMQ push "
        "or acknowledgement waiting while pending or for a submit); past it they get 429 at once. Keep it below the "
        "Ingress's max_ongoing_requests (512), so /health and encodes always find a slot.",
    )
    max_items_per_request: int = Field(16, ge=1, description="Most media items in one encode request.")
    max_video_frames: int = Field(64, ge=1, description="Most frames in one video item.")
    allowed_media_domains: list[str] = Field(
        default_factory=list,
        description='Hosts image URLs may be fetched from ("cdn.example.com", "*.example.com"); empty: no remote fetching.',
    )
    allowed_private_networks: list[str] = Field(
        default_factory=list,
        description="CIDRs that remote fetches may reach although they are not public (loopback, private, "
        "link-local such as cloud metadata, multicast are refused otherwise).",
    )
    allow_redirects: bool = Field(False, description="Follow HTTP redirects (each hop is checked again).")
    max_redirects: int = Field(3, ge=0, le=20, description="Most redirects followed for one image URL.")
    fetch_timeout_s: float = Field(10.0, gt=0, le=300, description="Seconds for one remote fetch, all hops included.")
    allowed_local_media_path: str | None = Field(
        None, description="Directory that file:// URLs and local paths may read from (resolved); absent: no local files."
    )
    max_item_bytes: int = Field(20 * _MiB, ge=1, description="Largest decoded media item, in bytes.")
    max_request_bytes: int = Field(64 * _MiB, ge=1, description="Largest HTTP request body, in bytes (else 413).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The vision tower to serve.")
    push_allowed_networks: list[str] = Field(
        default_factory=lambda: ["127.0.0.0/8", "::1/128"],
        description="CIDRs whose addresses a ZMQ receiver may ask the service to push to "
        "(POST /v1/requests/{req_id}/push); add your decoders' network.",
    )
    api_token: str | None = Field(
        None,
        min_length=16,
        description="Bearer token HTTP clients must send (Authorization: Bearer ...); /health stays open. "
        "Absent: the EPD_API_TOKEN environment variable of the ingress replicas, else no token.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        try:
            self.media_policy()  # checks the CIDRs and lists now, not at the first request
        except MediaError as exc:
            raise ValueError(str(exc)) from None
        self.push_networks()  # likewise
        if self.default_receive_count > self.max_receive_count:
            raise ValueError(
                f"default_receive_count ({self.default_receive_count}) exceeds max_receive_count "
                f"({self.max_receive_count})"
            )
        return self

    def media_policy(self) -> MediaPolicy:
        return MediaPolicy(
            allowed_media_domains=tuple(self.allowed_media_domains),
            allow_redirects=self.allow_redirects,
            max_redirects=self.max_redirects,
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_private_networks=tuple(self.allowed_private_networks),
            fetch_timeout_s=self.fetch_timeout_s,
            max_item_bytes=self.max_item_bytes,
        )

    def push_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        try:
            return [ipaddress.ip_network(cidr) for cidr in self.push_allowed_networks]
        except ValueError as exc:
            raise ValueError(f"push_allowed_networks: {exc}") from None

    def limits(self) -> Limits:
        """The registry's lifecycle limits (``registry.server.state.Limits``), from these keys."""
        return Limits(
            ttl_s=self.ttl_s,
            encode_timeout_s=self.encode_timeout_s,
            max_receive_count=self.max_receive_count,
            tombstone_ttl_s=self.tombstone_ttl_s,
            max_tombstones=self.max_tombstones,
            max_pending_requests=self.max_pending_requests,
            max_staged_bytes=self.max_staged_bytes,
            http_pull_grace_s=self.http_pull_grace_s,
            max_pending_input_bytes=self.max_pending_input_bytes,
        )

    def registry_settings(self, encoder_app: str, encoder_deployment: str = "Encoder") -> RegistrySettings:
        """What the registry actor runs with; it sends encodes to ``encoder_deployment`` of
        the Serve app ``encoder_app``."""
        return RegistrySettings(
            name=self.registry_name,
            namespace=self.registry_namespace,
            limits=self.limits(),
            default_receive_count=self.default_receive_count,
            registry_max_concurrency=self.registry_max_concurrency,
            registry_shards=self.registry_shards,
            cache_max_bytes=self.cache_max_bytes,
            max_object_store_fraction=self.max_object_store_fraction,
            encoder_app=encoder_app,
            encoder_deployment=encoder_deployment,
            encoder_call_max_items=self.encoder_call_max_items,
            niceness=self.registry_niceness,
        )


class ProxyConfig(BaseModel):
    """The ``EPDProxy`` app's ``args``: the vLLM server it fronts and the encoder app it stages into.

    YAML (a second application beside ``epd``)::

        applications:
          - name: epd-proxy
            route_prefix: /proxy
            import_path: deployments.app:build_proxy_app
            args:
              vllm_url: http://127.0.0.1:8000/llm
              tensor_parallel_size: 2
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    vllm_url: str = Field(
        "http://127.0.0.1:8000/llm",
        description="Base URL of the OpenAI-compatible vLLM server (http or https; /v1/... is appended).",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=4096, description="The vLLM instance's TP size: how many ranks fetch each staged item (its receive_count)."
    )
    encoder_app: str = Field("epd", min_length=1, description="Name of the Serve application of this encoder service.")
    timeout_s: float = Field(600.0, gt=0, description="Seconds for one upstream request (and for its items to be staged).")
    max_request_bytes: int = Field(64 * _MiB, ge=1, description="Largest chat request body, in bytes (else 413).")
    local_fallback: bool = Field(
        True,
        description="An image the encoder service cannot deliver (it is unreachable or overloaded, or the item's "
        "encode failed, expired, was cancelled or lost) is still forwarded, for vLLM to encode itself (its "
        "connector's local_fallback must be on too); false fails the chat with the item's error instead. A "
        "client's bad image fails the chat either way.",
    )

    @field_validator("vllm_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urllib.parse.urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vllm_url must be an http:// or https:// URL with a host, got {value!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"vllm_url must be a base URL without query or fragment, got {value!r}")
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
