"""Per-step lifecycle accounting: what was gathered, by phase, and what the drain had to release."""

import collections
from dataclasses import dataclass, field
from typing import Dict


@dataclass
class StepAccounting:
    """Counters for one training step (one forward + backward, reset at the next root forward).

    Keys of ``gathered_numel`` / ``gathered_bytes`` / ``gathered_params`` are
    ``"<phase>/<frozen|trainable>"`` with phase one of forward, recompute, backward.
    """
    gathered_numel: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    gathered_bytes: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    gathered_params: Dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    drained_invocations: int = 0
    drained_params: int = 0
    swept_params: int = 0
    evicted_params: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0

    def record_gather(self, phase: str, frozen: bool, numel: int, nbytes: int) -> None:
        key = f"{phase}/{'frozen' if frozen else 'trainable'}"
        self.gathered_numel[key] += numel
        self.gathered_bytes[key] += nbytes
        self.gathered_params[key] += 1
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def record_release(self, nbytes: int) -> None:
        self.live_bytes = max(0, self.live_bytes - nbytes)

    def as_dict(self) -> dict:
        return {
            "gathered_numel": dict(self.gathered_numel),
            "gathered_bytes": dict(self.gathered_bytes),
            "gathered_params": dict(self.gathered_params),
            "drained_invocations": self.drained_invocations,
            "drained_params": self.drained_params,
            "swept_params": self.swept_params,
            "evicted_params": self.evicted_params,
            "peak_live_bytes": self.peak_live_bytes,
        }


class LifecycleAccounting:
    """The current step's counters plus the last finished step's, and running totals of drains."""

    def __init__(self):
        self.current = StepAccounting()
        self.last_step = None
        self.total_drained_params = 0
        self.total_swept_params = 0

    def start_step(self) -> None:
        live = self.current.live_bytes
        self.last_step = self.current
        self.current = StepAccounting(live_bytes=live, peak_live_bytes=live)

    def record_drain(self, invocations: int, params: int, swept: int) -> None:
        self.current.drained_invocations += invocations
        self.current.drained_params += params
        self.current.swept_params += swept
        self.total_drained_params += params
        self.total_swept_params += swept
