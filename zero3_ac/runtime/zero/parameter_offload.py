"""ZeRO-3 module hooks with one invocation per firing.

Replaces upstream ``DeepSpeedZeRoOffload._register_deepspeed_module`` (the four hooks on every
module), ``release_backward_leftovers`` (0.19.3+) and extends ``partition_all_parameters``. The
gathering itself still goes through upstream's ``pre_sub_module_forward_function`` and
``pre_sub_module_backward_function``; releasing goes through the lifecycle only. Where a call's
backward starts and ends, the hooks learn from the autograd boundaries of ``backward_boundaries``.

Note: [The end of a backward]
    The first lifecycle event of a backward queues a callback on that graph task; it drains the
    lifecycle when the task ends. Nested graph tasks (reentrant checkpointing runs one per region)
    queue nothing: draining there would drop slots the outer backward has not reached yet.

Note: [A slot lives as long as its graph]
    A drain (end of a backward, a new root forward, ``partition_all_parameters``) keeps the pending
    slots whose opening nodes are still alive: another forward's backward may still come (see
    invocation_lifecycle's [Several forwards before a backward]). When the last opening node of a
    pending slot is freed, its call's graph is gone and the slot can never open; a weakref callback
    queues it, and the next hook event retires it and removes its input multi-grad hook. The
    callback only queues: it runs wherever the last reference drops, inside other hooks too.
"""

import itertools
import weakref

import torch
from deepspeed.runtime.zero import parameter_offload as upstream
from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.runtime.zero.utils import apply_to_tensors_only, is_zero_param
from deepspeed.utils import logger, z3_leaf_module

from zero3_ac.runtime.zero import autograd_context
from zero3_ac.runtime.zero.backward_boundaries import InputBoundary, OpenSlotOnGrad, SlotContext, slot_will_open
from zero3_ac.runtime.zero.borrowed_params import BorrowReads, report_reads_of, scope_is_over
from zero3_ac.runtime.zero.invocation_lifecycle import Phase, State
from zero3_ac.runtime.zero.partitioned_param_coordinator import InvocationParams, module_params
from zero3_ac.runtime.zero.zero_ordered_dict import use_lifecycle_getter
from zero3_ac.utils.z3_leaf_module import mark_gather_units, user_leaves_at

_UPSTREAM_RELEASE_AND_RESET_ALL = PartitionedParameterCoordinator.release_and_reset_all

LIFECYCLE_ATTR = "_zero3_ac_hooks"


def lifecycle_hooks(offload):
    """The fork's hooks object of a ``DeepSpeedZeRoOffload``, or None for a stock one."""
    return offload.__dict__.get(LIFECYCLE_ATTR)


def _top_level_tensors(output):
    if output is None:
        return []
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, (list, tuple)):
        return [item for item in output if torch.is_tensor(item)]
    items = output if isinstance(output, dict) else vars(output)
    return [value for key, value in items.items() if not key.startswith("__") and torch.is_tensor(value)]


def _any_requires_grad(value) -> bool:
    """Whether a tensor that ``apply_to_tensors_only`` would visit requires grad (without rebuilding)."""
    if torch.is_tensor(value):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_any_requires_grad(item) for item in value)
    if isinstance(value, dict):
        return any(_any_requires_grad(item) for item in value.values())
    return False


class ModuleInvocationHooks:
    """The per-invocation ZeRO-3 hooks of one engine (one ``DeepSpeedZeRoOffload``)."""

    def __init__(self, offload):
        self.offload = offload
        self.params = InvocationParams(offload.get_param_coordinator(),
                                       max_handoff_numel=offload._max_available_parameters_in_numel,
                                       will_open=slot_will_open)
        self.lifecycle = self.params.lifecycle
        self.accounting = self.params.accounting
        self._backward_task = None
        self._slots_awaiting_grad = {}
        self._unreachable_slots = []
        self._hooks_to_remove = []
        self._grad_hooks = {}  # param a slot has waited for -> its post-accumulate-grad hook handle
        self._trainable_by_module = {}
        self._params_under = {}  # module -> the params of its subtree, as of the last registration
        self.borrow_reads = BorrowReads()
        self.on_aborted_backward = None

    def bookkeeping_size(self) -> dict:
        """Sizes of everything kept per step, for leak checks: all zero once a step has drained
        and its graphs are freed."""
        return {
            **self.lifecycle.size(),
            "slots_awaiting_grad": sum(len(slots) for slots in self._slots_awaiting_grad.values()),
            "unreachable_slots": len(self._unreachable_slots),
            "input_grad_hooks": len(self._hooks_to_remove),
        }

    # ------------------------------------------------------------------ registration
    def register(self, root):
        """Give every module a ds_id and the fork's hooks (replaces ``_register_deepspeed_module``)."""
        if root is self.offload.module:
            coordinator = self.offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
        # Note: [Hooks removed from outside]
        #     TRL's ``unwrap_model_for_generation`` removes every handle in the offload's
        #     ``forward_hooks`` and ``backward_hooks`` around ``generate`` and registers the module
        #     hooks again afterwards; a param's grad hook must then be registered again too, or the
        #     slots that wait for its gradient never close.
        registered = {id(handle) for handle in self.offload.backward_hooks}
        self._grad_hooks = {param: handle for param, handle in self._grad_hooks.items() if id(handle) in registered}
        mark_gather_units(root, self.offload._max_available_parameters_in_numel)
        for module in root.modules():  # a leaf's (a gather unit's) modules too
            use_lifecycle_getter(module)
        self._params_under.clear()
        ids = itertools.count()
        stack = [root]
        while stack:
            module = stack.pop()
            module.ds_id = next(ids)
            self.borrow_reads.attach(module)
            leaf = z3_leaf_module(module)
            if leaf:
                for user_leaf in user_leaves_at(module):
                    for param in user_leaf.parameters():
                        param.ds_z3_leaf_module = user_leaf
            else:
                stack.extend(reversed(list(module.children())))
            self._register_hooks(module)

    def _register_hooks(self, module):
        offload = self.offload
        offload.forward_hooks.append(module.register_forward_pre_hook(self.pre_forward, with_kwargs=True))
        offload.forward_hooks.append(module.register_forward_hook(self.post_forward))

    def _hook_grad_of(self, param):
        """Give ``param`` the hook that tells the slots waiting for its gradient.

        Note: [A param's gradient hook, registered when a slot first waits for it]
            Only a call with no grad-requiring input waits for gradients (Note [When a call's
            backward starts and ends] in backward_boundaries.py): in a LoRA model, the calls of
            the first decoder layer, fed the frozen embedding's output. Every other trainable
            param's hook would run once per backward for nothing: autograd calls into Python for
            each, some 300 calls a step at 1.1B. So a param gets the hook when a slot first waits
            for it, in the forward before the backward that computes its gradient, and keeps it.
            The hook then runs after ZeRO-3's own gradient hook on that param instead of before
            it; neither reads what the other changes (the slot's release partitions the param's
            data, the reduction reads its gradient).
        """
        handle = self._grad_hooks[param] = param.register_post_accumulate_grad_hook(self._on_param_grad)
        self.offload.backward_hooks.append(handle)

    # ------------------------------------------------------------------ forward hooks
    # Note: [The hooks run eagerly under torch.compile]
    #     The lifecycle is host-side bookkeeping that must run at every call, and weakref callbacks
    #     change its queues between any two calls; traced by Dynamo, a restarted analysis takes
    #     another path (``SpeculationLogDivergence``). Like upstream's own module hooks, the fork's
    #     run outside the compiled graph.
    @torch.compiler.disable
    def pre_forward(self, module, args, kwargs):
        in_backward = autograd_context.in_backward()
        if in_backward:
            self._enter_backward()
            if self.lifecycle.inside_replay() and not autograd_context.saved_tensors_hooks_active():
                # Note: [A replay left on the stack]
                #     A replay stopped early (checkpoint early stop) stays on the call stack until
                #     the next backward event reaps it. A forward that runs inside a backward with
                #     no saved-tensors hook at all cannot be part of that replay, which runs under
                #     torch's recomputation hook: it is a reentrant checkpoint's recompute (inside a
                #     non-reentrant region), and must not inherit the replay.
                self._reap()
        elif module is self.offload.module:
            self.start_root_forward()
        if self._unreachable_slots:
            self._retire_unreachable()
        # A checkpoint nested in a replayed region replays with it: its own pack hook is on top.
        replay = in_backward and (self.lifecycle.inside_replay() or autograd_context.is_replay_recompute())
        invocation = self.lifecycle.open_forward(module,
                                                 in_backward,
                                                 replay=replay,
                                                 stack_depth=len(upstream.FWD_MODULE_STACK))
        self.params.phase = Phase.RECOMPUTE.value if in_backward else Phase.FORWARD.value
        with autograd_context.outside_selective_checkpoint():
            self.offload.pre_sub_module_forward_function(module)
        self.params.hold(module, invocation)
        if replay or not torch.is_grad_enabled():
            return None
        boundary = InputBoundary()
        args = apply_to_tensors_only(boundary.wrap, args)
        kwargs = apply_to_tensors_only(boundary.wrap, kwargs)
        if not boundary.wrapped:
            return None
        invocation.context = boundary
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module, args, output):
        invocation = self.lifecycle.innermost_forward(module)
        if invocation is None:
            return None
        del upstream.FWD_MODULE_STACK[invocation.stack_depth:]
        for param in self.params.hold_new_external_params(module, invocation):
            if not param.requires_grad:
                self._report_reads_of_owner(param)
        self._register_external_outputs(module, output)
        slot = None
        if not invocation.replay and torch.is_grad_enabled() and _any_requires_grad(output):
            slot = self._new_slot(module, invocation.context)
            if slot is not None and getattr(module, "_external_params", None):
                self._lend_borrows(module, slot)
        if slot is not None:
            wrapped_by_id = {}
            output = apply_to_tensors_only(lambda tensor: self._open_slot_on_grad(slot, tensor, wrapped_by_id),
                                           output)
        with autograd_context.outside_selective_checkpoint():
            self.params.release(self.lifecycle.close_forward(invocation, own_slot=slot), module)
            if invocation.phase is Phase.RECOMPUTE:
                self.params.evict_over_budget()
        return output

    def _open_slot_on_grad(self, slot, tensor, wrapped_by_id):
        """Wrap one output tensor, once per distinct tensor (see backward_boundaries.py [What a module's forward
        sees])."""
        if not tensor.requires_grad:
            return tensor
        wrapped = wrapped_by_id.get(id(tensor))
        if wrapped is None:
            wrapped = wrapped_by_id[id(tensor)] = OpenSlotOnGrad.apply(self, slot, tensor)
            unreachable = self._unreachable_slots
            slot.context.open_nodes.append(weakref.ref(wrapped.grad_fn, lambda ref: unreachable.append(slot)))
        return wrapped

    def _new_slot(self, module, boundary):
        """The call's backward slot, or None when its backward cannot need any param.

        With no grad-requiring input and no trainable param, an output can require grad only
        because a hook made it (``enable_input_require_grads`` on a frozen embedding): its
        backward runs no node of this call.
        """
        if boundary is not None:
            slot = self.lifecycle.new_slot(module)
            slot.context = SlotContext(input_hook=boundary.close_slot_when_done(self, slot))
            return slot
        # Note: [Calls with nothing to hold]
        #     A call with no grad-requiring input waits for the gradients of every trainable param
        #     under its module (backward_boundaries.py [When a call's backward starts and ends]):
        #     for the wrappers around a PEFT model (PeftModel, LoraModel, LlamaForCausalLM,
        #     LlamaModel), each of every adapter matrix, a subscription per param and wrapper at
        #     every step. Such a slot exists to hold the module's own and external params in its
        #     backward, and to take the holds a replay of the module hands off; a module with
        #     neither has a replay that holds nothing too. Its call gets no slot, as a call whose
        #     outputs need no grad; the engine's root module keeps its slot (Note [The root's
        #     outputs and DeepSpeed's accumulation hooks]).
        #
        # Note: [The root's outputs and DeepSpeed's accumulation hooks]
        #     DeepSpeed 0.18.5 to 0.19.2 scales gradients for accumulation with a hook on every tensor
        #     of the engine's output (``register_output_backward_hooks``, ``grad / gas``). A model that
        #     returns its loss beside a tensor the loss was computed from (an HF causal LM's loss and
        #     logits) sends the loss's gradient through both hooks: divided by the accumulation steps
        #     twice. Stock ZeRO-3 never shows it: its post-forward hook returns the root's outputs
        #     through an autograd Function, one per tensor, so the loss's graph reaches the logits
        #     before that Function, which carry no hook. A slot wraps a call's outputs the same way
        #     (``OpenSlotOnGrad``), so the root keeps its slot whatever it holds. (0.19.3+ scales
        #     once, for the graph ``engine.backward`` registers.)
        #
        # The root's slot that holds nothing (a PeftModel's) waits for no gradient either: waiting would
        # look at every trainable param of the model when the slot opens and at each one's gradient, to
        # close a slot that frees nothing. It closes at the end of its backward, with the drain.
        holds_nothing = not module_params(module)
        if holds_nothing and module is not self.offload.module:
            return None
        trainable = self._trainable_under(module)
        if not trainable:
            return None
        slot = self.lifecycle.new_slot(module)
        if holds_nothing:
            slot.context = SlotContext()
            return slot
        slot.context = SlotContext(awaited_params=trainable)
        grad_hooks = self._grad_hooks
        for param in trainable:
            self._slots_awaiting_grad.setdefault(param, []).append(slot)
            if param not in grad_hooks:
                self._hook_grad_of(param)
        return slot

    def _trainable_under(self, module):
        """The trainable params a call of ``module`` can produce gradients for; once per root forward
        (users may freeze or unfreeze params between steps)."""
        trainable = self._trainable_by_module.get(module)
        if trainable is None:
            params = self._params_under.get(module)
            if params is None:  # the tree under a module changes only with a registration
                params = self._params_under[module] = list(module.parameters())
            trainable = {param for param in params if param.requires_grad}
            trainable.update(param for param in module_params(module) if param.requires_grad)
            self._trainable_by_module[module] = trainable
        return trainable

    def _report_reads_of_owner(self, param):
        """A frozen param became borrowed: its owner's dict reports reads from now on (see
        borrowed_params' [Borrows inside a checkpointed region]); once per param."""
        for owner in self.offload.module.modules():
            if any(own is param for own in owner._parameters.values()):
                report_reads_of(owner)
                return

    def _lend_borrows(self, module, slot):
        """The borrows of this call that may end before its slot closes."""
        scopes = {}
        for param in module._external_params.values():
            scope = self.borrow_reads.scope(param)
            if scope is not None:
                scopes[param] = scope
        if scopes:
            self.lifecycle.lend(slot, scopes)

    def _register_external_outputs(self, module, output):
        """Params a module returns are external to it: its caller owns them (upstream's rule)."""
        stack = upstream.FWD_MODULE_STACK
        for tensor in _top_level_tensors(output):
            if not (is_zero_param(tensor) or hasattr(tensor, "ds_param_alias")):
                continue
            param = tensor if hasattr(tensor, "ds_id") else tensor.ds_param_alias
            if any(id(param) in outer._external_params for outer in stack):
                continue
            param.is_external_param = True
            register_external_parameter(stack[-1], param)
            if id(param) in module._external_params:
                unregister_external_parameter(module, param)
            param.all_gather()

    # ------------------------------------------------------------------ backward events
    def open_slot(self, slot):
        if slot.state is not State.PENDING:
            return
        self._enter_backward()
        self._reap()
        self.lifecycle.open_backward(slot)
        if slot.context is not None and slot.context.awaiting_grads:
            slot.context.await_only_computed_grads()
        self.params.phase = Phase.BACKWARD.value
        self.offload.pre_sub_module_backward_function(slot.module)
        self.params.hold(slot.module, slot)
        self.params.evict_over_budget()

    def close_slot(self, slot):
        if slot.state is State.CLOSED:
            return
        self._reap()
        self.params.release(self.lifecycle.close_backward(slot), slot.module)
        self._forget_slot(slot)
        if self.lifecycle.lending():
            self.params.release(self.lifecycle.end_borrows(scope_is_over))

    def _on_param_grad(self, param):
        """A trainable param has its gradient: close the open slots that waited for it last.

        Pending slots keep waiting: they belong to a forward whose backward has not started.
        """
        slots = self._slots_awaiting_grad.get(param)
        if not slots:
            return
        for slot in [slot for slot in slots if slot.state is State.OPEN]:
            slot.context.awaiting_grads.discard(param)
            if not slot.context.awaiting_grads:
                self.close_slot(slot)

    def _forget_slot(self, slot, remove_hook_now=False):
        """Drop the driver's data of a retired slot. Its input hook goes at the next drain, or now
        when it cannot be running (the slot's graph is gone)."""
        context = slot.context
        if context is None:
            return
        for param in context.awaited_params:
            slots = self._slots_awaiting_grad.get(param)
            if slots is not None and slot in slots:
                slots.remove(slot)
                if not slots:
                    del self._slots_awaiting_grad[param]
        if context.input_hook is not None:
            if remove_hook_now:
                context.input_hook.remove()
            else:
                self._hooks_to_remove.append(context.input_hook)
            context.input_hook = None

    def _retire_unreachable(self):
        """Retire the queued slots whose graph is gone.

        Removing a slot's input hook frees its call's input nodes, which may hold the last
        reference to the opening nodes of the calls that produced those inputs: their slots are
        queued while this runs, and retired by the same loop.
        """
        queue = self._unreachable_slots
        while queue:
            slot = queue.pop()
            if slot.context.reachable():
                continue
            if slot.state is State.PENDING:
                self.params.release(self.lifecycle.retire_unreachable(slot))
            if slot.state is State.CLOSED:
                self._forget_slot(slot, remove_hook_now=True)

    def _reap(self):
        """Close forwards that never reached their post-hook, and unwind upstream's module stack."""
        call_stack = self.lifecycle.call_stack
        if call_stack:
            del upstream.FWD_MODULE_STACK[call_stack[0].stack_depth:]
        self.params.release(self.lifecycle.reap_aborted())

    def _enter_backward(self):
        if self._backward_task is None:
            self._backward_task = autograd_context.graph_task_id()
            autograd_context.queue_end_of_backward_callback(self.end_of_backward)

    # ------------------------------------------------------------------ step boundaries
    def end_of_backward(self):
        self._backward_task = None
        self._drain("end of backward")

    def start_root_forward(self):
        aborted = self._backward_task is not None
        self._backward_task = None
        self._drain("start of forward", keep_reachable=not aborted)
        self._trainable_by_module.clear()
        self.params.start_step(self.offload.module)
        if aborted and self.on_aborted_backward is not None:
            self.on_aborted_backward()
        self.accounting.start_step()

    def _drain(self, where, keep_reachable=True):
        self.borrow_reads.clear()
        self._reap()
        self._retire_unreachable()
        reachable = (lambda slot: slot.context.reachable()) if keep_reachable else (lambda slot: False)
        retired = [slot for slot in self.lifecycle.live() if slot.phase is Phase.BACKWARD and not reachable(slot)]
        before = self.accounting.total_drained_params + self.accounting.total_swept_params
        self.params.drain(self.offload.module, reachable)
        for slot in retired:
            self._forget_slot(slot)
        for handle in self._hooks_to_remove:
            handle.remove()
        self._hooks_to_remove.clear()
        found = self.accounting.total_drained_params + self.accounting.total_swept_params - before
        if found:
            logger.debug(f"zero3_ac: drain at {where} released {found} params still gathered")


def register_deepspeed_module(offload, module, count=None):
    """Replacement of ``DeepSpeedZeRoOffload._register_deepspeed_module``."""
    hooks = lifecycle_hooks(offload)
    if hooks is None:
        hooks = ModuleInvocationHooks(offload)
        offload.__dict__[LIFECYCLE_ATTR] = hooks
    hooks.register(module)


def release_backward_leftovers(offload, stock):
    """Replacement of ``DeepSpeedZeRoOffload.release_backward_leftovers`` (0.19.3+)."""
    hooks = lifecycle_hooks(offload)
    if hooks is None:
        return stock(offload)
    hooks.end_of_backward()


def partition_all_parameters(offload, stock):
    """Replacement of ``DeepSpeedZeRoOffload.partition_all_parameters``: forget every hold, then release
    and check every param in one pass (Note [The step boundary's release in one pass] in
    partitioned_param_coordinator.py); upstream's where the coordinator's ``release_and_reset_all`` is
    not upstream's own."""
    hooks = lifecycle_hooks(offload)
    if hooks is None:
        return stock(offload)
    hooks.end_of_backward()
    coordinator = offload.get_param_coordinator()
    if getattr(coordinator.release_and_reset_all, "__func__", None) is not _UPSTREAM_RELEASE_AND_RESET_ALL:
        return stock(offload)
    hooks.params.release_and_reset_all(offload.module)
