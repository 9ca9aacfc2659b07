"""Record every gather and release of a ZeRO-3 engine's params, in order: the lifecycle timeline.

Opt-in and stock-neutral: it listens to the engine coordinator's tap only while recording.

    recorder = TimelineRecorder(engine)
    with recorder:
        loss = engine(batch); engine.backward(loss); engine.step()
    recorder.gathered_bytes()   # by "<phase>/<frozen|trainable>", as zero3_ac.lifecycle_stats counts
    recorder.save("timeline.json")
"""

import json
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from zero3_ac.runtime.zero.partitioned_param_coordinator import TapListener, param_nbytes
from zero3_ac.utils.gather_meter import engine_tap


@dataclass
class LifecycleEvent:
    """One gather or release. ``invocation``: under the fork, the id of the invocation that held the
    param after this gather (for a release, after the gather it ends); None on stock DeepSpeed."""
    seq: int
    time_s: float
    kind: str
    phase: str
    ds_id: int
    nbytes: int
    frozen: bool
    live_bytes: int
    invocation: Optional[int] = None


class TimelineRecorder(TapListener):
    """The gathers and releases of one engine while recording (``with recorder:`` or start/stop)."""

    def __init__(self, engine):
        self.tap = engine_tap(engine)
        self.events: List[LifecycleEvent] = []
        self._open_gathers: Dict[int, LifecycleEvent] = {}
        self._unheld: Dict[int, LifecycleEvent] = {}
        self._start = None
        self._live = 0

    def start(self) -> "TimelineRecorder":
        self.events, self._open_gathers, self._unheld, self._live = [], {}, {}, 0
        self._start = time.perf_counter()
        self.tap.add(self)
        return self

    def stop(self) -> None:
        self.tap.remove(self)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # ------------------------------------------------------------------ tap events
    def gathered(self, param, phase):
        nbytes = param_nbytes(param)
        if not param.ds_persist:
            self._live += nbytes
        event = self._append("gather", phase, param, nbytes)
        self._open_gathers[param.ds_id] = event
        self._unheld[param.ds_id] = event

    def held(self, invocation_id, params):
        for param in params:
            event = self._unheld.pop(param.ds_id, None)
            if event is not None:
                event.invocation = invocation_id

    def released(self, param, phase):
        nbytes = param_nbytes(param)
        if not param.ds_persist:
            self._live -= nbytes
        gather = self._open_gathers.pop(param.ds_id, None)
        self._unheld.pop(param.ds_id, None)
        event = self._append("release", phase, param, nbytes)
        event.invocation = gather.invocation if gather is not None else None

    def _append(self, kind, phase, param, nbytes) -> LifecycleEvent:
        event = LifecycleEvent(seq=len(self.events), time_s=time.perf_counter() - self._start, kind=kind, phase=phase,
                               ds_id=param.ds_id, nbytes=nbytes, frozen=not param.requires_grad,
                               live_bytes=self._live)
        self.events.append(event)
        return event

    # ------------------------------------------------------------------ summaries
    def gathered_bytes(self) -> Dict[str, int]:
        """Gathered bytes by ``"<phase>/<frozen|trainable>"`` (the keys of the fork's accounting)."""
        return self._sum("gather")

    def released_bytes(self) -> Dict[str, int]:
        return self._sum("release")

    def still_gathered(self) -> List[int]:
        """ds_ids gathered while recording and not released since."""
        return sorted(self._open_gathers)

    def _sum(self, kind) -> Dict[str, int]:
        totals: Dict[str, int] = {}
        for event in self.events:
            if event.kind == kind:
                key = f"{event.phase}/{'frozen' if event.frozen else 'trainable'}"
                totals[key] = totals.get(key, 0) + event.nbytes
        return totals

    def as_dict(self) -> dict:
        return {"events": [asdict(event) for event in self.events]}

    def save(self, path) -> None:
        with open(path, "w") as out:
            json.dump(self.as_dict(), out)
