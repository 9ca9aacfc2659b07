"""Measure what one ZeRO-3 engine gathers and releases, on stock DeepSpeed and on the fork alike.

It listens to the engine coordinator's :class:`CoordinatorTap` and keeps the same per-step counters
as the fork's accounting (:class:`StepAccounting`), so that tests, the demo and the benchmarks
compare stock and fork with one instrument.
"""

from zero3_ac.runtime.zero.accounting import StepAccounting
from zero3_ac.runtime.zero.partitioned_param_coordinator import CoordinatorTap, TapListener, param_nbytes


def engine_tap(engine) -> CoordinatorTap:
    """The tap of a ZeRO-3 engine's param coordinator (installed on first use)."""
    offload = getattr(engine.optimizer, "parameter_offload", None)
    if offload is None:
        raise ValueError("zero3_ac: gathers can be measured on a ZeRO stage 3 engine only "
                         f"(this one runs stage {engine.zero_optimization_stage()}).")
    return CoordinatorTap.of(offload.get_param_coordinator())


class GatherMeter(TapListener):
    """Gathered bytes by phase, re-gathers, and the peak of gathered bytes since the last reset."""

    def __init__(self, engine):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        engine_tap(engine).add(self)
        self.live_bytes = sum(param_nbytes(p) for p in engine.module.parameters()
                              if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist)
        self.reset()

    def reset(self):
        self.step = StepAccounting(live_bytes=self.live_bytes, peak_live_bytes=self.live_bytes)

    def take(self) -> dict:
        taken = dict(phase_bytes=self.phase_bytes, peak_bytes=self.peak_bytes,
                     backward_peak_bytes=self.backward_peak_bytes, regathered_bytes=dict(self.step.regathered_bytes))
        self.reset()
        return taken

    @property
    def phase_bytes(self) -> dict:
        return self.step.phase_bytes()

    @property
    def peak_bytes(self) -> int:
        return self.step.peak_live_bytes

    @property
    def backward_peak_bytes(self) -> int:
        return self.step.backward_peak_live_bytes

    def frozen_regathers(self) -> dict:
        """ds_id -> times, for frozen params released and gathered again during backward."""
        return self.step.frozen_backward_regathers()

    def gathered(self, param, phase):
        self.step.record_gather(phase, not param.requires_grad, param.ds_id, param.ds_numel, param_nbytes(param),
                                param.ds_persist)
        self.live_bytes = self.step.live_bytes

    def released(self, param, phase):
        self.step.record_release(phase, param.ds_id, param_nbytes(param), param.ds_persist)
        self.live_bytes = self.step.live_bytes
