"""Gather and release for invocations: extends upstream ``partitioned_param_coordinator.py``.

Upstream's ``PartitionedParameterCoordinator`` keeps doing what it does well: all-gathers,
prefetching from the recorded trace, the reuse-distance policy. What changes is who may release:
``fetch_sub_module`` still marks params with the module's ``ds_id``; :meth:`InvocationParams.hold`
swaps that mark for the invocation's id, and params are released only through the lifecycle, never
by ``release_sub_module``.

:class:`CoordinatorTap` is the one wrapper of a coordinator's all-gather and release. It works on
stock DeepSpeed too: the fork's accounting, the gather meter and the timeline recorder listen to it.
"""

import operator

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.runtime.zero.utils import is_zero_param
from deepspeed.utils import z3_leaf_module

from zero3_ac.runtime.zero.accounting import LifecycleAccounting
from zero3_ac.runtime.zero.invocation_lifecycle import InvocationLifecycle, TraceReuse
from zero3_ac.runtime.zero.kept_partition_release import KeptPartitionRelease, ReleasedData
from zero3_ac.runtime.zero.whole_param_shards import WholeParamShards
from zero3_ac.utils import module_tree

_PRIVATE = "_PartitionedParameterCoordinator__"
_AVAILABLE = ZeroParamStatus.AVAILABLE
_NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE
_TAP_ATTR = "_zero3_ac_tap"


_PARAMS_CACHE_ATTR = "_zero3_ac_params"
_MODEL_PARAMS_CACHE_ATTR = "_zero3_ac_model_params"
_ZERO_MODEL_PARAMS_CACHE_ATTR = "_zero3_ac_zero_model_params"


def _externals(module):
    externals = getattr(module, "_external_params", None)
    return tuple(externals) if externals else ()


def module_params(module):
    """The params a module's hooks gather: its own (all of them for a z3 leaf) and external ones.

    Computed once per module and kept while the module's own params, its external params and its
    leaf marking stay the same (checked by identity and size: O(1) per call for a module without
    external params) and no module tree changed shape (Note [Module trees that change shape]),
    since the hooks ask for every module call.
    """
    leaf = z3_leaf_module(module)
    key = (module._parameters.__len__(), _externals(module), leaf, module_tree.generation())
    cached = module.__dict__.get(_PARAMS_CACHE_ATTR)
    if cached is not None and cached[0] == key:
        return cached[1]
    params = list(iter_params(module, recurse=leaf))
    module.__dict__[_PARAMS_CACHE_ATTR] = (key, params)
    return params


def model_params(module):
    """Every param of ``module``'s tree and its external ones, upstream's ``iter_params(module,
    recurse=True)``, walked once per tree shape (Note [Module trees that change shape])."""
    return module_tree.cached_walk(module, _MODEL_PARAMS_CACHE_ATTR, lambda root: iter_params(root, recurse=True),
                                   extra_key=_externals(module))


def zero_model_params(module):
    """The ZeRO-3 params among :func:`model_params` (not the plain ones of a module attached after
    ``initialize``), filtered once per tree shape."""
    return module_tree.cached_walk(module, _ZERO_MODEL_PARAMS_CACHE_ATTR,
                                   lambda root: [param for param in model_params(root) if is_zero_param(param)],
                                   extra_key=_externals(module))


def cached_iter_params(module, recurse=False):
    """Replacement of upstream ``iter_params`` in ``partitioned_param_coordinator.py`` and
    ``parameter_offload.py``: the cached :func:`module_params` when asked for what a module's hooks
    gather (``recurse`` is the module's leaf marking), which ``fetch_sub_module`` asks for about
    twenty times a fetch (its prefetch looks at the modules ahead); the cached :func:`model_params`
    for a whole tree, which the step boundary walks three times. Anything else goes to upstream's."""
    if recurse == z3_leaf_module(module):
        return module_params(module)
    if recurse:
        return model_params(module)
    return iter_params(module, recurse)


def param_nbytes(param) -> int:
    return param.ds_numel * param.element_size()


class TapListener:
    """What a :class:`CoordinatorTap` tells its listeners; each method may be left as is."""

    def gathered(self, param, phase: str) -> None:
        """``param`` was partitioned and is being all-gathered now."""

    def released(self, param, phase: str) -> None:
        """``param`` was gathered and has just been partitioned."""

    def gathered_all(self, params, phase: str) -> None:
        """Each of ``params`` was partitioned and is being all-gathered now (one module's fetch)."""
        for param in params:
            self.gathered(param, phase)

    def released_all(self, params, phase: str) -> None:
        """Each of ``params`` was gathered and has just been partitioned (one release of the lifecycle's)."""
        for param in params:
            self.released(param, phase)

    def held(self, invocation_id: int, params) -> None:
        """Under the fork: the invocation ``invocation_id`` holds ``params`` (right after their fetch)."""


class CoordinatorTap:
    """The one wrapper of a coordinator's name-mangled all-gather and release (per instance).

    Note: [Phases seen from the coordinator]
        Outside a backward graph task every gather and release is FORWARD. Inside one, upstream's
        ``forward`` flag of the latest ``fetch_sub_module`` tells a recompute (a forward pre-hook)
        from a backward: a module's release follows its own fetch, or that of a module inside it.
        Under the fork the hooks know the phase exactly and pass ``phase_source`` instead; the
        fetch is then not wrapped.

    Note: [Releases that release nothing]
        Upstream's ``__release_param`` partitions a param only when it is gathered and no module is
        active on it; each call first goes through torch's dynamo-disable wrapper and the NVTX
        decorator. Its ``release_and_reset_all`` calls it for every param of the model at every
        step, almost all of them partitioned already. Under the fork the tap returns at once for a
        param the release would leave as it is; on a stock engine (a meter listening) it calls
        through, so that stock costs what it costs.

    Note: [A release of many params at once]
        The lifecycle frees a call's params together: at a forward call's end, a backward slot's
        close, the drain. Released one by one through ``__release_param``, each param costs about
        seven Python frames (the coordinator's attribute, the tap, the whole-shard and kept-partition
        checks, the phase, each listener and its counters), where the work per param is a swap of
        its data and its status. ``release_all`` does to each param what that call does, in one
        pass: the same filter (gathered, no module active on it), the whole-shard path, the
        kept-partition path, upstream's release for the rest; the coordinator's count of available
        elements is lowered once by the sum, and each listener hears of the released params once,
        in one phase. Where something wrapped the coordinator's ``__release_param`` after the fork
        did, the lifecycle calls it for each param, so that the wrapper sees every release.

    Note: [The step boundary's release in one pass]
        ZeRO-3's ``step()`` begins with ``partition_all_parameters``: upstream's ``release_and_reset_all``
        walks every param of the model, waiting on its in-flight gather, clearing its set of active
        modules and calling ``__release_param``, and both then walk every param again to check that it is
        partitioned: three walks and some five Python frames per param at every step, on an idle GPU
        (an 8B LoRA model has about 1,000 params). Under the fork the drain has released what the
        lifecycle held just before; the fork then does the same to the cached list of the model's params,
        with no Python frame per param: the coordinator's in-flight gathers waited on and released, every
        set of active modules cleared, the gathered params released in one ``release_all`` (persistent
        ones too, as upstream does, except in ``step()``: Note [Persistent params across the step]), the
        same check and error. A plain torch param (its module attached after ``initialize``) fails the
        step with an error that names it, where upstream fails on its missing ``ds_active_sub_modules``.

    Note: [Persistent params across the step]
        Upstream's ``step()`` releases every param, persistent ones (``ds_persist``: below
        ``stage3_param_persistence_threshold``, which a LoRA adapter and a norm weight are) too, and
        gathers the persistent ones again at its end (``_post_step``), through ``Init``'s blocking
        all-gather: per param a partition-size query (some ten Python calls), a ``.to`` and a view,
        then a device synchronize. At 1.1B that is 353 params a step, and 2.6 to 2.9 ms of the step on one
        H100 (benchmarks/results/2026-12-06-1xh100-phases-and-ab).
        A param on the path of [A shard that is the whole param] whose data is its shard (the same
        storage, where the shard is now) gets nothing from this: the optimizer writes the updated
        values into that storage in place, and ``_unflatten_partitioned_parameters`` points the shard
        at the same place again, so the gather at the end would make the same view of the same
        values. Such params stay gathered through ``step()``, and ``_post_step`` finds them available.
        A persistent param whose data is anything else (its shard moved, as a checkpoint load may
        do) is released and gathered again as upstream does; outside ``step()`` (checkpointing,
        ``empty_partition_cache``) every param is released.

    Under the fork, a param whose partition is the whole param is gathered and released by the tap's
    ``whole_shards`` instead of upstream (Note [A shard that is the whole param] in whole_param_shards.py),
    and any other param whose partition stays as it is is released by its ``kept_partitions`` (Note [A
    release that frees only the gathered data] in kept_partition_release.py); the listeners hear of
    them as of any other.
    """

    def __init__(self, coordinator, phase_source=None):
        self.listeners = []
        self.phase_source = phase_source
        self.whole_shards = None  # under the fork: the WholeParamShards path, set by InvocationParams
        self.kept_partitions = None  # under the fork: the KeptPartitionRelease path, set with whole_shards
        self._fetch_forward = True
        self._gather = getattr(coordinator, _PRIVATE + "all_gather_params")
        self._release = getattr(coordinator, _PRIVATE + "release_param")
        # Instance attributes shadow the (name-mangled) methods for this coordinator only.
        setattr(coordinator, _PRIVATE + "all_gather_params", self._all_gather_params)
        setattr(coordinator, _PRIVATE + "release_param", self._release_param)
        if phase_source is None:
            self._fetch = coordinator.fetch_sub_module
            coordinator.fetch_sub_module = self._fetch_sub_module

    @classmethod
    def of(cls, coordinator, phase_source=None) -> "CoordinatorTap":
        """The coordinator's tap, installed on first use (the fork installs it with its ``phase_source``)."""
        tap = coordinator.__dict__.get(_TAP_ATTR)
        if tap is None:
            tap = coordinator.__dict__[_TAP_ATTR] = cls(coordinator, phase_source)
        return tap

    def add(self, listener: TapListener) -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)

    def remove(self, listener: TapListener) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def phase(self) -> str:
        if self.phase_source is not None:
            return self.phase_source()
        if torch._C._current_graph_task_id() == -1:
            return "forward"
        return "recompute" if self._fetch_forward else "backward"

    def held(self, invocation_id: int, params) -> None:
        for listener in self.listeners:
            listener.held(invocation_id, params)

    def _fetch_sub_module(self, current_submodule, forward):
        self._fetch_forward = forward
        return self._fetch(current_submodule, forward=forward)

    def _all_gather_params(self, params, forward):
        if self.listeners:
            gathering = [param for param in params if param.ds_status == _NOT_AVAILABLE]
            if gathering:
                phase = self.phase()
                for listener in self.listeners:
                    listener.gathered_all(gathering, phase)
        if self.whole_shards is not None:
            params = self.whole_shards.gather(params)
            if not params:
                return None
        return self._gather(params, forward)

    def _release_param(self, param, free_data=True):
        was_available = param.ds_status == _AVAILABLE
        if self.phase_source is not None and (not was_available or param.ds_active_sub_modules):
            return
        if not (free_data and self.whole_shards is not None
                and (self.whole_shards.release(param) or self.kept_partitions.release(param))):
            self._release(param, free_data)
        if was_available and self.listeners and param.ds_status == _NOT_AVAILABLE:
            phase = self.phase()
            for listener in self.listeners:
                listener.released(param, phase)

    def release_all(self, params) -> None:
        """Under the fork: what ``__release_param`` does to each of ``params`` in turn, in one pass (Note [A
        release of many params at once])."""
        params = [param for param in params if param.ds_status == _AVAILABLE and not param.ds_active_sub_modules]
        if not params:
            return
        rest = params
        if self.whole_shards is not None:
            rest = self.kept_partitions.release_all(self.whole_shards.release_all(rest))
        for param in rest:
            self._release(param, True)
        if self.listeners:
            released = params if not rest else [param for param in params if param.ds_status == _NOT_AVAILABLE]
            phase = self.phase()
            for listener in self.listeners:
                listener.released_all(released, phase)


class InvocationParams:
    """Companion of one engine's coordinator: holds params for invocations and releases them."""

    def __init__(self, coordinator, max_handoff_numel: int, will_open):
        self.coordinator = coordinator
        self.accounting = LifecycleAccounting()
        # attrgetter: the holder set is read at every hold and release, and a C callable costs no Python frame.
        self.lifecycle = InvocationLifecycle(numel=operator.attrgetter("ds_numel"),
                                             frozen=lambda param: not param.requires_grad,
                                             holder_set=operator.attrgetter("ds_active_sub_modules"),
                                             max_handoff_numel=max_handoff_numel,
                                             will_open=will_open)
        self.phase = "forward"
        self._reuse = None  # (the complete trace, the registration count, its TraceReuse, answers per call site)
        self.tap = CoordinatorTap.of(coordinator, phase_source=self._tap_phase)
        self.tap.add(self.accounting)
        device = torch.device(get_accelerator().current_device_name())
        released_data = ReleasedData(device)
        self.tap.kept_partitions = KeptPartitionRelease(coordinator, _PRIVATE, released_data, device)
        self.tap.whole_shards = WholeParamShards(coordinator, _PRIVATE, released_data)
        self._whole_model = False
        self.stepping = False  # inside the optimizer's step() (Note [Persistent params across the step])
        self._upstream_fetch = coordinator.fetch_sub_module
        coordinator.fetch_sub_module = self._fetch_sub_module

    def start_step(self, root_module) -> None:
        """At each root forward: how this step's fetches run (Note [A fetch of whole shards])."""
        self._whole_model = self.tap.whole_shards.covers(model_params(root_module))

    def _fetch_sub_module(self, current_submodule, forward):
        if self._whole_model:
            return self.tap.whole_shards.fetch(module_params(current_submodule), forward)
        return self._upstream_fetch(current_submodule, forward=forward)

    def _tap_phase(self) -> str:
        # The hooks set ``phase`` when a forward call or a backward slot opens, so a slot that
        # closes after a recompute ran would read "recompute"; a recompute runs only while a
        # forward invocation is open.
        if self.phase == "recompute" and not self.lifecycle.forward_running():
            return "backward"
        return self.phase

    def _release_all(self, params) -> None:
        """Release ``params`` through the coordinator's ``__release_param``: the tap's, in one pass while nobody
        has wrapped it since; else whoever wrapped it sees each release."""
        release_param = getattr(self.coordinator, _PRIVATE + "release_param")
        if release_param == self.tap._release_param:
            self.tap.release_all(params)
        else:
            for param in params:
                release_param(param)

    # ------------------------------------------------------------------ holds
    def hold(self, module, invocation) -> None:
        """Right after upstream fetched ``module``: make ``invocation`` the holder of its params."""
        # 0.19.3+ records backward modules here for its recompute attribution; the lifecycle
        # replaces that attribution, so the registry stays empty and the attribution never fires.
        backward_registry = getattr(self.coordinator, _PRIVATE + "active_backward_submodules", None)
        if backward_registry:
            backward_registry.clear()
        params = module_params(module)
        for param in params:
            param.ds_active_sub_modules.discard(module.ds_id)
        self.lifecycle.hold(invocation, params)
        invocation.fetched_params = params
        self.tap.held(invocation.id, params)

    def hold_new_external_params(self, module, invocation) -> list:
        """At a forward call's end: hold the params that became the module's external params during
        the call, so that they are released with the call's other params.

        Note: [Params the getter gathers]
            Reading a partitioned param inside the engine's forward (a module reading a child's
            ``weight``) makes ZeRO-3's parameter getter gather it on the spot and register it as an
            external param of the module on top of DeepSpeed's module stack. Stock releases it with
            that module's params at the module's end; the fork releases only what invocations hold,
            so the call that was running holds it too. Returns those params.
        """
        params = module_params(module)
        if params is invocation.fetched_params:
            return []
        new = [param for param in params if param not in invocation.holds]
        if new:
            for param in new:
                param.ds_active_sub_modules.discard(module.ds_id)
            self.lifecycle.hold(invocation, new)
            self.tap.held(invocation.id, new)
        return new

    def release(self, params, module=None) -> None:
        """Release params the lifecycle freed, under upstream's persistence and reuse rules.

        With ``module`` given and a complete trace, params that the trace says are reused soon stay
        gathered (``stage3_max_reuse_distance``), as upstream does at a module's release.
        """
        if not params:
            return
        if module is not None and self.coordinator.is_complete_trace():
            releasable = self._releasable(module, getattr(self.coordinator, _PRIVATE + "step_id"))
            params = [param for param in params
                      if not (param.ds_persist or param.is_external_param) and param.ds_id in releasable]
        else:
            params = [param for param in params if not (param.ds_persist or param.is_external_param)]
        self._release_all(params)

    def _releasable(self, module, step_id):
        """The ds_ids of ``module``'s params that its release at trace position ``step_id`` partitions:
        upstream's ``__params_to_release``, with each later fetch's own gather set (the rules'
        [Reuse distance]). A param that the prefetcher fetched ahead for a later position stays."""
        fetched_for = getattr(self.coordinator, _PRIVATE + "most_recent_step_id_param_fetched_for")
        return {
            param.ds_id
            for param in self._not_reused(module, step_id) if fetched_for.get(param, step_id) <= step_id
        }

    def _not_reused(self, module, step_id):
        """``module``'s non-persistent params that the trace does not fetch again within the reuse distance
        from ``step_id``: computed once per complete trace, tree shape, module and position."""
        order = getattr(self.coordinator, _PRIVATE + "submodule_order")
        generation = module_tree.generation()
        if self._reuse is None or self._reuse[0] is not order or generation is None or self._reuse[1] != generation:
            reuse = TraceReuse([[(param.ds_id, param.ds_numel) for param in module_params(fetched)] for fetched in order])
            self._reuse = (order, generation, reuse, {})
        _, _, reuse, answers = self._reuse
        key = (module, step_id)
        params = answers.get(key)
        if params is None:
            max_elements = getattr(self.coordinator, _PRIVATE + "max_reuse_dist_in_numel")
            params = answers[key] = [
                param for param in module_params(module)
                if not param.ds_persist and not reuse.reused_within(param.ds_id, step_id, max_elements)
            ]
        return params

    def evict_over_budget(self) -> None:
        evicted = self.lifecycle.evict_over_budget()
        self.accounting.current.evicted_params += len(evicted)
        self.release(evicted)

    def drain(self, root_module, reachable=lambda slot: False) -> None:
        """Release everything still held, then anything else left gathered (the safety net).

        Pending slots that are still ``reachable`` are kept, without holds. A module attached after
        ``deepspeed.initialize`` has plain torch params: stock registers no hooks on it and its
        forward uses them as they are, so the sweep passes over them too.
        """
        report = self.lifecycle.drain(reachable)
        self.release(report.params)
        self.coordinator._clean_inflight_param_registry()
        swept = self.release_unheld(root_module)
        self.accounting.record_drain(report.invocations, len(report.params), swept)

    def release_and_reset_all(self, root_module) -> None:
        """Upstream's ``release_and_reset_all`` and the check after it in ``partition_all_parameters``, over
        the cached params (Note [The step boundary's release in one pass]); in ``step()``, the persistent
        params that are their whole shards stay gathered (Note [Persistent params across the step])."""
        params = zero_model_params(root_module)
        if len(params) != len(model_params(root_module)):
            name = next((name for name, param in root_module.named_parameters() if not is_zero_param(param)), "?")
            raise RuntimeError(
                f"zero3_ac: {name} is a plain torch param, not a ZeRO-3 one: its module was attached to the model "
                "after deepspeed.initialize, so ZeRO-3 neither partitions it nor gives it to the optimizer. Attach "
                "modules before deepspeed.initialize (stock DeepSpeed fails here too, in release_and_reset_all).")
        self.coordinator._clean_inflight_param_registry()
        for param in params:
            param.ds_active_sub_modules.clear()
        if self.stepping:
            whole_shards = self.tap.whole_shards
            params = [param for param in params if not (param.ds_persist and whole_shards.views_its_shard(param))]
        self._release_all(params)
        for param in params:
            if param.ds_status != _NOT_AVAILABLE:
                raise RuntimeError(f"{param.ds_summary()} expected to be released")

    def release_unheld(self, root_module) -> int:
        """Release every gathered param that nothing holds (persistent and external ones excepted);
        returns how many."""
        unheld = [
            param for param in zero_model_params(root_module) if param.ds_status == _AVAILABLE
            and not param.ds_persist and not param.is_external_param and not param.ds_active_sub_modules
        ]
        self._release_all(unheld)
        return len(unheld)
