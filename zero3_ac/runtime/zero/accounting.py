"""Per-step lifecycle accounting: what was gathered, by phase, what was gathered again, what the drain released.

Note: [Re-gathers]
    A step runs two passes over the params: the *forward pass* (FORWARD, outside any backward) and
    the *backward pass* (RECOMPUTE and BACKWARD, inside the backward). A gather is a *re-gather*
    when the same param was released earlier in the same pass of the same step: a consumer in this
    pass needed it again after the release. It is counted under the key
    ``"<phase of that release>-><phase of this gather>/<frozen|trainable>"``:
    - ``recompute->backward``: released at the end of its recompute, gathered again by the backward
      that consumes the recompute (stock 0.19.3+ under non-reentrant checkpointing);
    - ``forward->forward``, ``recompute->recompute``, ``backward->backward``: released and gathered
      again within one phase (a module called twice under a zero reuse distance, a budget eviction);
    - ``backward->recompute``: a region recomputed after a backward that released its params.
    A gather after a release in the other pass (the forward's release, then the recompute) is the
    expected one. A param gathered twice in a pass was released in between, so this counts those
    too. Each gather and release costs one dict operation more.
"""

import collections
import os
from dataclasses import dataclass, field
from typing import Dict

STEP_LOG_ENV = "ZERO3_AC_LOG_STEPS"
PHASES = ("forward", "recompute", "backward")
BACKWARD_PASS = ("recompute", "backward")
_KINDS = {True: "frozen", False: "trainable"}
_KEYS = {(phase, frozen): f"{phase}/{kind}" for phase in PHASES for frozen, kind in _KINDS.items()}
_step_logging = [os.environ.get(STEP_LOG_ENV, "").strip().lower() not in ("", "0", "false", "no")]


def set_step_logging(enabled: bool) -> None:
    """Log one line per finished step through DeepSpeed's logger (rank 0). Default: ``ZERO3_AC_LOG_STEPS``."""
    _step_logging[0] = bool(enabled)


def step_logging() -> bool:
    return _step_logging[0]


def _counter():
    return collections.defaultdict(int)


@dataclass
class StepAccounting:
    """Counters for one training step (one forward + backward, reset at the next root forward).

    Keys of ``gathered_numel`` / ``gathered_bytes`` / ``gathered_params`` are
    ``"<phase>/<frozen|trainable>"`` with phase one of forward, recompute, backward; keys of
    ``regathered_params`` / ``regathered_bytes`` are described in [Re-gathers].
    """
    gathered_numel: Dict[str, int] = field(default_factory=_counter)
    gathered_bytes: Dict[str, int] = field(default_factory=_counter)
    gathered_params: Dict[str, int] = field(default_factory=_counter)
    regathered_params: Dict[str, int] = field(default_factory=_counter)
    regathered_bytes: Dict[str, int] = field(default_factory=_counter)
    regathered_ids: Dict[str, collections.Counter] = field(default_factory=dict)
    drained_invocations: int = 0
    drained_params: int = 0
    swept_params: int = 0
    evicted_params: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0
    backward_peak_live_bytes: int = 0
    _forward_releases: Dict[int, str] = field(default_factory=dict, repr=False)
    _backward_releases: Dict[int, str] = field(default_factory=dict, repr=False)

    def record_gather(self, phase: str, frozen: bool, ds_id: int, numel: int, nbytes: int,
                      persistent: bool = False) -> None:
        self.record_gathers(phase, ((frozen, ds_id, numel, nbytes, persistent), ))

    def record_gathers(self, phase: str, gathers) -> None:
        """``gathers``: (frozen, ds_id, numel, nbytes, persistent) of each param gathered in ``phase``."""
        releases = self._backward_releases if phase in BACKWARD_PASS else self._forward_releases
        live_bytes = self.live_bytes
        for frozen, ds_id, numel, nbytes, persistent in gathers:
            key = _KEYS[phase, frozen]
            self.gathered_numel[key] += numel
            self.gathered_bytes[key] += nbytes
            self.gathered_params[key] += 1
            earlier = releases.pop(ds_id, None)
            if earlier is not None:
                self._record_regather(f"{earlier}->{key}", ds_id, nbytes)
            if not persistent:
                live_bytes += nbytes
        self.live_bytes = live_bytes
        if live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = live_bytes
        if phase in BACKWARD_PASS and live_bytes > self.backward_peak_live_bytes:
            self.backward_peak_live_bytes = live_bytes

    def _record_regather(self, key: str, ds_id: int, nbytes: int) -> None:
        self.regathered_params[key] += 1
        self.regathered_bytes[key] += nbytes
        self.regathered_ids.setdefault(key, collections.Counter())[ds_id] += 1

    def record_release(self, phase: str, ds_id: int, nbytes: int, persistent: bool = False) -> None:
        self.record_releases(phase, ((ds_id, nbytes, persistent), ))

    def record_releases(self, phase: str, releases) -> None:
        """``releases``: (ds_id, nbytes, persistent) of each param released in ``phase``."""
        released_in = self._backward_releases if phase in BACKWARD_PASS else self._forward_releases
        live_bytes = self.live_bytes
        for ds_id, nbytes, persistent in releases:
            released_in[ds_id] = phase
            if not persistent:
                live_bytes = max(0, live_bytes - nbytes)
        self.live_bytes = live_bytes

    def close(self) -> None:
        """Forget what each pass released (the step is over; its counters stay)."""
        self._forward_releases = {}
        self._backward_releases = {}

    def phase_bytes(self) -> Dict[str, int]:
        """Gathered bytes by phase, frozen and trainable together."""
        totals = dict.fromkeys(PHASES, 0)
        for key, nbytes in self.gathered_bytes.items():
            totals[key.split("/")[0]] += nbytes
        return totals

    def frozen_backward_regathers(self) -> Dict[int, int]:
        """ds_id -> re-gathers in the backward pass, for frozen params."""
        times = collections.Counter()
        for key, ids in self.regathered_ids.items():
            if key.endswith("/frozen") and key.split("->")[0] in BACKWARD_PASS:
                times.update(ids)
        return dict(times)

    def as_dict(self) -> dict:
        return {
            "gathered_numel": dict(self.gathered_numel),
            "gathered_bytes": dict(self.gathered_bytes),
            "gathered_params": dict(self.gathered_params),
            "regathered_params": dict(self.regathered_params),
            "regathered_bytes": dict(self.regathered_bytes),
            "drained_invocations": self.drained_invocations,
            "drained_params": self.drained_params,
            "swept_params": self.swept_params,
            "evicted_params": self.evicted_params,
            "peak_live_bytes": self.peak_live_bytes,
            "backward_peak_live_bytes": self.backward_peak_live_bytes,
        }

    def summary(self) -> str:
        """One line: gathered and re-gathered MiB by phase, drains, peak."""
        mib = 1024 * 1024
        phases = self.phase_bytes()
        regathered = sum(self.regathered_bytes.values())
        return (f"gathered MiB fwd/rec/bwd {phases['forward'] / mib:.2f}/{phases['recompute'] / mib:.2f}/"
                f"{phases['backward'] / mib:.2f}, re-gathered {sum(self.regathered_params.values())} params "
                f"({regathered / mib:.2f} MiB), drained {self.drained_params} + swept {self.swept_params} params, "
                f"peak gathered {self.peak_live_bytes / mib:.2f} MiB")


class LifecycleAccounting:
    """The current step's counters plus the last finished step's, and running totals of drains.

    It listens to the engine's :class:`~zero3_ac.runtime.zero.partitioned_param_coordinator.CoordinatorTap`.
    """

    def __init__(self):
        self.current = StepAccounting()
        self.last_step = None
        self.steps = 0
        self.total_drained_params = 0
        self.total_swept_params = 0
        self.total_regathered_params = 0

    def gathered(self, param, phase: str) -> None:
        self.current.record_gather(phase, not param.requires_grad, param.ds_id, param.ds_numel,
                                   param.ds_numel * param.element_size(), param.ds_persist)

    def released(self, param, phase: str) -> None:
        self.current.record_release(phase, param.ds_id, param.ds_numel * param.element_size(), param.ds_persist)

    def gathered_all(self, params, phase: str) -> None:
        self.current.record_gathers(phase, [(not param.requires_grad, param.ds_id, param.ds_numel,
                                             param.ds_numel * param.element_size(), param.ds_persist)
                                            for param in params])

    def released_all(self, params, phase: str) -> None:
        self.current.record_releases(phase, [(param.ds_id, param.ds_numel * param.element_size(), param.ds_persist)
                                             for param in params])

    def held(self, invocation_id: int, params) -> None:
        pass

    def start_step(self) -> None:
        finished = self.current
        finished.close()
        live = finished.live_bytes
        if any(finished.gathered_params.values()) or finished.drained_params or finished.swept_params:
            self.steps += 1
            self.total_regathered_params += sum(finished.regathered_params.values())
            if step_logging():
                from deepspeed.utils import log_dist
                log_dist(f"zero3_ac step {self.steps}: {finished.summary()}", ranks=[0])
        self.last_step = finished
        self.current = StepAccounting(live_bytes=live, peak_live_bytes=live)

    def record_drain(self, invocations: int, params: int, swept: int) -> None:
        self.current.drained_invocations += invocations
        self.current.drained_params += params
        self.current.swept_params += swept
        self.total_drained_params += params
        self.total_swept_params += swept
