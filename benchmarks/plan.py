"""How much each section measures in the default and the ``--quick`` mode, and the run context.

The default mode is sized to finish in about 6 minutes on a 2-core machine and
the quick mode (a CI smoke test: it checks that every figure is produced, not
how fast) in one to two minutes: its samples are nearly free, and what is left is
starting the processes and the ViT-B forward passes every figure needs. Both produce the same figures; quick takes fewer
samples, so its percentiles are rough.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from benchmarks.stats import Results

# The sections, in the report's order; they run staging first (its cold burst needs
# object-store pages no other section has touched).
SECTIONS = ("fetch", "staging", "registry", "scale", "memory", "e2e")
RUN_ORDER = ("staging", "fetch", "registry", "scale", "memory", "e2e")
# Embedding sizes of the fetch and staging sections (0.5, 4.7 and 19 MB):
# 64, 576 and 2304 tokens of a 4096-wide bfloat16 embedding.
SIZES = (64 * 8192, 576 * 8192, 2304 * 8192)


@dataclasses.dataclass(frozen=True)
class Plan:
    mode: str
    fetch_rounds: int  # staged entries per size; each is fetched once by each of the ranks
    fetch_ranks: int  # rank processes (RankProbe actors); the registry section needs 4, its receive_count
    staging_rounds: int  # submits per size (and as many ray.puts and memcpys)
    staging_cold_items: int  # objects held at once in the cold (fresh pages) burst
    raw_calls: int  # no-op calls per concurrency level
    lifecycles: int  # lifecycles per concurrency level
    lifecycle_concurrency: tuple[int, ...]
    scale_rounds: int  # interleaved rounds of the scale section's fetch_many and quiet fetch
    scale_batch: int  # requests per fetch_many there
    memory_burst: int  # requests in the memory burst
    e2e_concurrency: tuple[int, ...]
    e2e_window_s: float  # measured window per concurrency level and path (after a warm-up)
    e2e_warmup_s: float
    e2e_warmup_images: int  # per path and model, sent before anything is timed (a full batch warms the batch shape)
    inprocess_s: float  # seconds of the in-process baseline, per variant
    image_pool: int  # distinct images cycled through by the end-to-end clients
    prefaulted_setup_overlaps: bool  # set the pre-faulted staging node up while the next sections run (noisier)
    blocking_cleanup: bool  # wait for apps no longer needed to be deleted before measuring on (quick: do not)

    @classmethod
    def default(cls) -> "Plan":
        return cls(
            mode="default",
            fetch_rounds=10,
            fetch_ranks=4,
            staging_rounds=30,
            staging_cold_items=16,
            raw_calls=2000,
            lifecycles=400,
            lifecycle_concurrency=(1, 16, 64),
            scale_rounds=30,
            scale_batch=32,
            memory_burst=32,
            e2e_concurrency=(1, 4, 16, 64),
            e2e_window_s=3.5,
            e2e_warmup_s=1.5,
            e2e_warmup_images=8,
            inprocess_s=3.0,
            image_pool=512,
            prefaulted_setup_overlaps=False,
            blocking_cleanup=True,
        )

    @classmethod
    def quick(cls) -> "Plan":
        return cls(
            mode="quick",
            fetch_rounds=1,
            fetch_ranks=4,
            staging_rounds=2,
            staging_cold_items=4,
            raw_calls=300,
            lifecycles=40,
            lifecycle_concurrency=(16,),
            scale_rounds=2,
            scale_batch=4,
            memory_burst=8,
            e2e_concurrency=(2,),  # also the in-process batch: a quarter of the ViT-B passes of 8
            e2e_window_s=1.0,
            e2e_warmup_s=0.2,
            e2e_warmup_images=1,  # per path: one batch of 2, the shape measured
            inprocess_s=0.3,
            image_pool=32,
            prefaulted_setup_overlaps=True,
            blocking_cleanup=False,
        )


class Progress:
    """One progress bar on stderr over the run's steps (tqdm; a plain counter without it)."""

    def __init__(self, total: int, enabled: bool = True):
        self._bar: Any = None
        self._done, self._total = 0, total
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)
            except ImportError:  # pragma: no cover - tqdm comes with transformers
                self._bar = None

    def step(self, label: str, n: int = 1) -> None:
        self._done += n
        if self._bar is not None:
            self._bar.set_description_str(label, refresh=False)
            self._bar.update(n)
        else:
            print(f"[{self._done}/{self._total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclasses.dataclass
class Context:
    """What every section gets: the plan, the results so far, the progress bar, the cluster."""

    plan: Plan
    results: Results
    progress: Progress
    cluster: dict[str, Any]
    token: str  # per-run suffix of every name this run creates
    probes: Any = None  # benchmarks.probes.Probes, started before Serve (None if no section needs them)

    def name(self, base: str) -> str:
        return f"{base}_{self.token}"
