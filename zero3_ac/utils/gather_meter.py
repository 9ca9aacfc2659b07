"""Measure what one ZeRO-3 engine gathers and releases, on stock DeepSpeed and on the fork alike.

It wraps the engine coordinator's all-gather and release (name-mangled, per instance), so that
tests, the demo and the benchmarks compare stock and fork with one instrument.
"""

import collections

import torch

_PRIVATE = "_PartitionedParameterCoordinator__"
PHASES = ("forward", "recompute", "backward")


def current_phase(forward: bool) -> str:
    """Forward outside a backward; inside one, upstream's ``forward`` flag tells recompute from backward."""
    if torch._C._current_graph_task_id() == -1:
        return "forward"
    return "recompute" if forward else "backward"


def _nbytes(param) -> int:
    return param.ds_numel * param.element_size()


class GatherMeter:
    """Gathered bytes by phase, gathers per param during backward, and gathered bytes over time."""

    def __init__(self, engine):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        self._available = ZeroParamStatus.AVAILABLE
        self._not_available = ZeroParamStatus.NOT_AVAILABLE
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        self._gather = getattr(coordinator, _PRIVATE + "all_gather_params")
        self._release = getattr(coordinator, _PRIVATE + "release_param")
        setattr(coordinator, _PRIVATE + "all_gather_params", self._all_gather_params)
        setattr(coordinator, _PRIVATE + "release_param", self._release_param)
        self.live_bytes = sum(_nbytes(p) for p in engine.module.parameters()
                              if p.ds_status == self._available and not p.ds_persist)
        self.reset()

    def reset(self):
        self.phase_bytes = dict.fromkeys(PHASES, 0)
        self.backward_gathers = collections.Counter()
        self.peak_bytes = self.live_bytes
        self.backward_peak_bytes = 0

    def take(self) -> dict:
        taken = dict(phase_bytes=dict(self.phase_bytes), peak_bytes=self.peak_bytes,
                     backward_peak_bytes=self.backward_peak_bytes)
        self.reset()
        return taken

    def frozen_regathers(self) -> dict:
        """ds_id -> times, for frozen params gathered more than once during backward."""
        return {p.ds_id: n for p, n in self.backward_gathers.items() if n > 1 and not p.requires_grad}

    def _all_gather_params(self, params, forward):
        phase = current_phase(forward)
        for param in params:
            if param.ds_status == self._not_available:
                self.phase_bytes[phase] += _nbytes(param)
                if phase != "forward":
                    self.backward_gathers[param] += 1
                if not param.ds_persist:
                    self.live_bytes += _nbytes(param)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if phase != "forward":
            self.backward_peak_bytes = max(self.backward_peak_bytes, self.live_bytes)
        return self._gather(params, forward)

    def _release_param(self, param, free_data=True):
        was_gathered = param.ds_status == self._available and not param.ds_persist
        self._release(param, free_data)
        if was_gathered and param.ds_status == self._not_available:
            self.live_bytes -= _nbytes(param)
