"""What the SGLang receiver harness records: the multimodal-processor stand-in and SGLang's receiver log.

SGLang's receivers hand an assembled embedding to ``mm_processor.get_validated_mm_data``;
the stand-in here records what SGLang passes it (the embedding per modality and the
kwargs such as ``img_grid_thw``) and returns a small picklable object with
``input_ids`` (the real processor would need the model's processor files).
``describe`` turns that record into the ``sha256``/``dtype``/``shape`` entries of
``results.json``; ``keep_receiver_log`` keeps the receiver's warnings and errors, and
``configure_logging`` sets SGLang's log format in each of the harness's processes.
Used by the driver (``sglang_tokenizer_driver.py``) and the ranks
(``sglang_scheduler_rank.py``) of ``tests/sglang_ranks.py``.
"""

from __future__ import annotations

import hashlib
import time

PROMPT_IDS = [151644, 872, 198, 151652, 151655, 151653, 151645]  # any ids: the stand-in processor ignores them


class RecordedMMInputs:
    """What the stand-in ``get_validated_mm_data`` returns: SGLang sets it as ``recv_req.mm_inputs``.

    Picklable, and defined in an importable module rather than the script's ``__main__``,
    because it travels with the request from the driver to the ranks.
    """

    def __init__(self, input_ids, embeddings, meta, held_at):
        self.input_ids = list(input_ids)
        self.embeddings = embeddings  # modality name -> tensor, as SGLang handed it over
        self.meta = meta  # the non-None kwargs (img_grid_thw, ...)
        self.held_at = held_at  # time.monotonic() when SGLang handed it over


class RecordingProcessor:
    """Stands in for the model's multimodal processor; records each ``get_validated_mm_data`` call."""

    prefer_tokenized_input = True

    def __init__(self):
        self.calls = 0

    def get_validated_mm_data(self, prompt, recv_embedding, **kwargs):
        held_at = time.monotonic()
        self.calls += 1
        embeddings = {getattr(m, "name", str(m)): t for m, t in dict(recv_embedding).items()}
        meta = {k: v for k, v in kwargs.items() if v is not None}
        input_ids = prompt if isinstance(prompt, list) else list(PROMPT_IDS)
        return RecordedMMInputs(input_ids, embeddings, meta, held_at)


def describe(mm_inputs) -> dict:
    """sha256/dtype/shape per modality and the grid of recorded mm inputs."""
    import torch

    out = {"embeddings": {}, "img_grid_thw": None, "meta_keys": []}
    if mm_inputs is None:
        return out
    for name, tensor in mm_inputs.embeddings.items():
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()  # the bytes as they lie in memory, no copy
        out["embeddings"][name] = {
            "sha256": hashlib.sha256(raw).hexdigest(), "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape), "nbytes": raw.nbytes,
        }
    grid = mm_inputs.meta.get("img_grid_thw")
    if grid is not None:
        out["img_grid_thw"] = grid.tolist() if hasattr(grid, "tolist") else list(grid)
    out["meta_keys"] = sorted(mm_inputs.meta)
    return out


def keep_receiver_log() -> list:
    """Keep (monotonic time, level, message) of SGLang's receiver warnings and errors in this process."""
    import logging

    records: list[tuple[float, str, str]] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            records.append((time.monotonic(), record.levelname, record.getMessage()))

    logging.getLogger("sglang.srt.disaggregation.encoder.receiver").addHandler(_Keep(level=logging.WARNING))
    return records


def configure_logging(level: str, who: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format=f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s",
                        force=True)
