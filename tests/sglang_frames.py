"""Reading the service's SGLang messages in the test process, without SGLang.

``load_header`` loads frame 0 the way SGLang's ``safe_pickle_loads`` does: an
unpickler that resolves only the globals on an allowlist, here mapped to stand-ins
for SGLang's ``EmbeddingData`` and ``Modality`` (and torch's own ``LongTensor`` and
dtypes). A header naming any other global fails to load, as it would in SGLang.
``PullRank`` is one TP rank's PULL socket, bound as SGLang's scheduler binds it.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any

import torch
import zmq


class EmbeddingData:
    """Stands in for ``sglang.srt.disaggregation.encoder.receiver.EmbeddingData``."""


class Modality(enum.Enum):
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


_ALLOWED: dict[tuple[str, str], Any] = {
    ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"): EmbeddingData,
    ("sglang.srt.multimodal.modality", "Modality"): Modality,
    ("torch", "LongTensor"): torch.LongTensor,
    **{("torch", name): getattr(torch, name) for name in ("float32", "float16", "bfloat16")},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not on SGLang's allowlist") from None


def load_header(frame: bytes) -> EmbeddingData:
    return _Unpickler(io.BytesIO(bytes(frame))).load()


def embedding(header: EmbeddingData, frame: bytes) -> torch.Tensor:
    """What SGLang's ``WaitingZmqRequest`` makes of frame 1."""
    return torch.frombuffer(bytearray(frame), dtype=header.dtype).reshape(header.shape)


class PullRank:
    """A TP rank's PULL socket on 127.0.0.1; ``receive_url`` is what it registers."""

    def __init__(self, context: zmq.Context):
        self.socket = context.socket(zmq.PULL)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.receive_url = f"127.0.0.1:{port}"

    def receive(self, timeout_s: float = 30.0) -> list[bytes] | None:
        """The next message's frames, or None when none came within ``timeout_s``."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(linger=0)
