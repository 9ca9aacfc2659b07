"""The per-invocation parameter lifecycle of ZeRO-3: who holds a gathered param, and when it may go.

This module is pure: it imports neither torch nor DeepSpeed. It sees modules and params as opaque
hashable keys and is driven by the adapters in ``parameter_offload.py`` and
``partitioned_param_coordinator.py``, which translate ZeRO-3 module hooks into the events below.

Note: [Invocations and holds]
    Every firing of a module's forward hooks is one *invocation*, with a unique negative id and a
    phase: FORWARD (outside any backward), RECOMPUTE (a forward that runs inside a backward graph
    task, i.e. an activation-checkpoint recompute) or BACKWARD (one module call's backward). A
    gathered param is *held* by the live invocations that need it; it may be released only when
    it has no holder. Ids are negative so they can share ``param.ds_active_sub_modules`` with the
    non-negative module ``ds_id`` values that stock DeepSpeed code puts there.

Note: [Backward slots and the ownership map]
    A forward invocation whose outputs require grad creates a BACKWARD invocation in state PENDING:
    the *slot* for that call's backward. It opens when the call's first output gradient arrives and
    closes when its last input gradient has been produced. A RECOMPUTE invocation does not release
    its params when its forward ends: it hands its holds to the slot that consumes its activations
    (the ownership map below), and they are released when that slot closes. For a *replay*
    recompute (non-reentrant checkpoint: the recomputed tensors feed the original graph) that slot
    is the newest unclosed, unmatched slot of the same module from the original forward. For a
    reentrant recompute (its own graph is backpropagated) it is the slot the recompute created
    itself. A recompute with no consumer (its outputs need no grad) releases at its forward end.

Note: [Slots that will not open]
    A replay's slot may never open in the running backward (``will_open`` is False): nothing being
    differentiated depends on the call's outputs (an extra output the caller drops, an aux head's
    unused logits). The replay then has no consumer, but it keeps its holds until the next
    backward event rather than releasing at its forward end: its outputs required grad, so the
    recompute saved tensors, frozen params among them, and torch's checkpoint compares those when
    the whole recompute ends.

Note: [Several forwards before a backward]
    One engine may run several root forwards before a backward consumes them: a DPO step computes
    the policy's and the reference's log-probs with one PEFT model (the reference under
    ``no_grad`` with the adapters off), two losses may be summed into one backward, or two
    backwards may each consume their own forward. A slot therefore lives as long as its call's
    graph can still reach it, not until the next root forward: a drain retires forward
    invocations, open slots and hand-offs, but keeps a pending slot that the driver says is
    still reachable (its holds are dropped; it gathers when it opens). The driver retires a
    pending slot once its graph is gone (``retire_unreachable``).

Note: [Borrows a recompute re-reads]
    A module whose forward reads another module's param *borrows* it (ZeRO-3's getter registers
    it as the module's external param), and its backward slot holds it like its own: the module's
    code may use it in an op whose backward comes after the owner's. The driver may know more:
    a borrow read only inside a region whose recompute reads it again is needed, in the backward,
    only by what that recompute records (see borrowed_params' [Borrows inside a checkpointed
    region]). Such a hold is *lent*: it ends as soon as the driver says its scope is over, which
    the lifecycle asks at every slot close (``end_borrows``), and at the latest when the slot
    closes. Everything else about the slot is unchanged.

Note: [Aborted forwards]
    A forward whose post-hook never runs (checkpoint early stop raises inside the recompute, or an
    exception) leaves its invocation on the call stack. Any backward event proves that no forward
    is running any more, so the next one *reaps* such invocations: it closes them as their
    post-hook would have. The next root forward and the end of every backward graph task *drain*
    whatever is still held; a drain that finds anything is a bug the lifecycle should not have.
"""

import bisect
import enum
import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Set, Tuple


class Phase(enum.Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"


class State(enum.Enum):
    PENDING = "pending"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(eq=False)
class Invocation:
    id: int
    module: Hashable
    phase: Phase
    state: State
    replay: bool = False
    holds: Set[Hashable] = field(default_factory=set)
    matched: bool = False
    stack_depth: int = -1
    context: object = None  # the driver's own data for this invocation; opaque here
    fetched_params: object = None  # the driver's list of the params it fetched for this invocation; opaque here
    lent: Dict[Hashable, object] = field(default_factory=dict)  # param -> the driver's scope of the borrow

    def __repr__(self):
        return f"Invocation({self.id}, {self.module!r}, {self.phase.value}, {self.state.value})"


@dataclass
class DrainReport:
    """What a drain found: invocations still live and params they were the last holders of."""
    invocations: int = 0
    params: List[Hashable] = field(default_factory=list)


class InvocationLifecycle:
    """State machine of invocations and the params they hold.

    ``numel`` gives a param's full size; it is used only for the live-parameter budget.
    ``frozen`` tells whether a param needs no grad: a frozen param handed off by the recompute
    that is still running is never evicted (torch's checkpoint still checks its shape).
    ``will_open`` tells whether a pending slot will still open in the running backward.
    Methods that can free params return them; the caller releases those it may release.
    """

    def __init__(self,
                 numel: Callable[[Hashable], int] = lambda param: 1,
                 frozen: Callable[[Hashable], bool] = lambda param: False,
                 holder_set: Optional[Callable[[Hashable], Set[int]]] = None,
                 max_handoff_numel: Optional[int] = None,
                 will_open: Callable[["Invocation"], bool] = lambda slot: True):
        self._numel = numel
        self._frozen = frozen
        self._will_open = will_open
        self.max_handoff_numel = max_handoff_numel
        self._ids = itertools.count(1)
        self._live: Dict[int, Invocation] = {}
        # Where a param's holder ids live: by default here; the ZeRO-3 adapter passes
        # ``param.ds_active_sub_modules``, so that stock release checks see the holds too.
        own_sets: Dict[Hashable, Set[int]] = {}
        self._holder_set = holder_set or (lambda param: own_sets.setdefault(param, set()))
        self._held: Set[Hashable] = set()
        self._call_stack: List[Invocation] = []
        self._slots_by_module: Dict[Hashable, List[Invocation]] = {}
        # (slot id, param) -> recompute batch, in hand-off order: the eviction queue.
        self._handoffs: Dict[Tuple[int, Hashable], int] = {}
        self._unconsumed_replays: List[Invocation] = []
        self._batch = 0
        self._latest_recompute_batch = 0
        self._recompute_since_backward = False
        self._lending: Set[Invocation] = set()  # live slots with lent holds

    # ------------------------------------------------------------------ queries
    def holders(self, param: Hashable) -> Set[int]:
        return set(self._holder_set(param)) if param in self._held else set()

    def is_held(self, param: Hashable) -> bool:
        return param in self._held

    def live(self) -> List[Invocation]:
        return list(self._live.values())

    @property
    def call_stack(self) -> List[Invocation]:
        return list(self._call_stack)

    def forward_running(self) -> bool:
        """Whether a forward invocation is open (its post-hook not run, nor reaped)."""
        return bool(self._call_stack)

    def inside_replay(self) -> bool:
        """Whether the innermost running forward is part of a replay recompute."""
        return bool(self._call_stack) and self._call_stack[-1].replay

    def innermost_forward(self, module: Hashable) -> Optional[Invocation]:
        """The newest forward invocation of ``module`` still on the call stack."""
        for inv in reversed(self._call_stack):
            if inv.module == module:
                return inv
        return None

    def pending_slots(self, module: Hashable) -> List[Invocation]:
        return [s for s in self._slots_by_module.get(module, ()) if s.state is not State.CLOSED]

    def size(self) -> Dict[str, int]:
        """Bookkeeping sizes, for leak checks: all zero once a step has drained."""
        return {
            "invocations": len(self._live),
            "held_params": len(self._held),
            "call_stack": len(self._call_stack),
            "slot_modules": len(self._slots_by_module),
            "handoffs": len(self._handoffs),
            "unconsumed_replays": len(self._unconsumed_replays),
            "lending_slots": len(self._lending),
        }

    # ------------------------------------------------------------------ forward side
    def open_forward(self,
                     module: Hashable,
                     in_backward: bool,
                     replay: bool = False,
                     stack_depth: int = -1) -> Invocation:
        """A module's forward pre-hook fired. ``in_backward``: it runs inside a backward graph task.

        ``stack_depth`` is opaque to the lifecycle: the caller's own call-stack depth, kept on the
        invocation so that the caller can unwind its stack when the invocation is reaped.
        """
        if replay and not in_backward:
            raise ValueError("a replay recompute runs inside a backward")
        phase = Phase.RECOMPUTE if in_backward else Phase.FORWARD
        if in_backward:
            self._recompute_since_backward = True
            self._latest_recompute_batch = self._batch
        inv = self._new(module, phase, State.OPEN, replay=replay)
        inv.stack_depth = stack_depth
        self._call_stack.append(inv)
        return inv

    def new_slot(self, module: Hashable) -> Invocation:
        """The backward invocation of one forward call whose outputs require grad."""
        slot = self._new(module, Phase.BACKWARD, State.PENDING)
        self._slots_by_module.setdefault(module, []).append(slot)
        return slot

    def hold(self, inv: Invocation, params: Iterable[Hashable]) -> None:
        if inv.state is State.CLOSED:
            raise ValueError(f"{inv} is closed and cannot hold params")
        if not isinstance(params, (list, tuple)):
            params = list(params)
        inv.holds.update(params)
        self._held.update(params)
        inv_id = inv.id
        for holders in map(self._holder_set, params):
            holders.add(inv_id)

    def close_forward(self, inv: Invocation, own_slot: Optional[Invocation] = None) -> List[Hashable]:
        """A forward post-hook fired. ``own_slot`` is the slot this call created (if any).

        Returns the params this invocation was the last holder of.
        """
        if inv.phase is Phase.BACKWARD:
            raise ValueError(f"{inv} is not a forward invocation")
        if own_slot is not None and own_slot.phase is not Phase.BACKWARD:
            raise ValueError(f"{own_slot} is not a backward slot")
        if inv.state is State.CLOSED:
            return []
        freed = self._pop_call_stack_to(inv)
        freed.extend(self._retire_forward(inv, own_slot))
        return freed

    def lend(self, slot: Invocation, scopes: Dict[Hashable, object]) -> None:
        """Mark the slot's holds of these params, once it has them, as borrows that may end before
        the slot closes (see [Borrows a recompute re-reads]); ``scopes`` is the driver's data."""
        if slot.phase is not Phase.BACKWARD or slot.state is State.CLOSED:
            raise ValueError(f"{slot} is not a live backward slot")
        if scopes:
            slot.lent.update(scopes)
            self._lending.add(slot)

    def lending(self) -> bool:
        return bool(self._lending)

    def end_borrows(self, is_over: Callable[[Hashable, object], bool]) -> List[Hashable]:
        """End the lent holds of open slots whose scope ``is_over``; returns the params left unheld."""
        freed: List[Hashable] = []
        for slot in list(self._lending):
            if slot.state is not State.OPEN:
                continue
            for param, scope in list(slot.lent.items()):
                if param in slot.holds and is_over(param, scope):
                    del slot.lent[param]
                    if self._drop_hold(slot, param):
                        freed.append(param)
            if not slot.lent:
                self._lending.discard(slot)
        return freed

    # ------------------------------------------------------------------ backward side
    def open_backward(self, slot: Invocation) -> List[Hashable]:
        """The first output gradient of the slot's call arrived. Reaps aborted forwards first."""
        freed = self.reap_aborted()
        if slot.state is State.PENDING:
            slot.state = State.OPEN
        return freed

    def close_backward(self, slot: Invocation) -> List[Hashable]:
        """The slot's call has produced its input gradients: release what it holds."""
        freed = self.reap_aborted()
        if slot.state is State.CLOSED:
            return freed
        freed.extend(self._retire(slot))
        return freed

    def reap_aborted(self) -> List[Hashable]:
        """Close forward invocations whose post-hook never ran (see [Aborted forwards])."""
        freed: List[Hashable] = []
        while self._call_stack:
            freed.extend(self._retire_forward(self._call_stack.pop(), None))
        while self._unconsumed_replays:
            freed.extend(self._retire(self._unconsumed_replays.pop()))
        if self._recompute_since_backward:
            self._recompute_since_backward = False
            self._batch += 1
        return freed

    def retire_unreachable(self, slot: Invocation) -> List[Hashable]:
        """A pending slot whose call's graph is gone can never open: retire it."""
        if slot.state is not State.PENDING:
            return []
        return self._retire(slot)

    def drain(self, reachable: Callable[[Invocation], bool] = lambda slot: False) -> DrainReport:
        """Retire every live invocation but the pending slots still ``reachable`` (end of a
        backward graph task, a new root forward; see [Several forwards before a backward]).

        A kept slot loses its holds (they count as drained) and may be matched again.
        """
        report = DrainReport()
        self._call_stack.clear()
        for inv in list(self._live.values()):
            if inv.phase is Phase.BACKWARD and inv.state is State.PENDING and reachable(inv):
                inv.matched = False
                if inv.holds:
                    report.invocations += 1
                    report.params.extend(self._drop_holds(inv))
                continue
            report.invocations += 1
            report.params.extend(self._retire(inv))
        self._handoffs.clear()
        self._unconsumed_replays.clear()
        self._recompute_since_backward = False
        return report

    # ------------------------------------------------------------------ budget
    def handoff_numel(self) -> int:
        """Size of the distinct params kept alive only by hand-offs to slots not yet opened."""
        return sum(self._numel(p) for p in self._handoff_only_params())

    def evict_over_budget(self) -> List[Hashable]:
        """Drop the oldest hand-offs while their size exceeds the budget.

        Hand-offs of the latest recompute batch are never dropped: while it runs, the checkpoint
        still has to compare the recomputed tensors (frozen params among them) when it ends, and
        right after it, its backward is the next consumer, so dropping them would only buy a
        gather. Older batches are dropped oldest first; their slots gather again when they open.
        """
        if self.max_handoff_numel is None or not self._handoffs:
            return []
        # Hand-offs are stamped with a batch that never decreases, and a re-stamp moves one to the
        # end: the first one is the oldest. Nothing older than the latest batch: nothing to evict.
        if next(iter(self._handoffs.values())) >= self._latest_recompute_batch:
            return []
        freed: List[Hashable] = []
        over = self.handoff_numel() - self.max_handoff_numel
        for (slot_id, param), batch in list(self._handoffs.items()):
            if over <= 0:
                break
            if batch >= self._latest_recompute_batch:
                continue
            slot = self._live.get(slot_id)
            if slot is None or slot.state is not State.PENDING:
                continue
            if self._drop_hold(slot, param):
                freed.append(param)
            over = self.handoff_numel() - self.max_handoff_numel
        return freed

    # ------------------------------------------------------------------ internals
    def _new(self, module, phase, state, replay=False) -> Invocation:
        inv = Invocation(id=-next(self._ids), module=module, phase=phase, state=state, replay=replay)
        self._live[inv.id] = inv
        return inv

    def _pop_call_stack_to(self, inv: Invocation) -> List[Hashable]:
        """Pop ``inv`` off the call stack, retiring anything above it (aborted inner forwards)."""
        freed: List[Hashable] = []
        if inv not in self._call_stack:
            return freed
        while self._call_stack:
            top = self._call_stack.pop()
            if top is inv:
                break
            freed.extend(self._retire_forward(top, None))
        return freed

    def _retire_forward(self, inv: Invocation, own_slot: Optional[Invocation]) -> List[Hashable]:
        if inv.state is State.CLOSED:
            return []
        consumer = self._consumer_of(inv, own_slot)
        if consumer is None:
            return self._retire(inv)
        if inv.replay and consumer.state is State.PENDING and not self._will_open(consumer):
            self._unconsumed_replays.append(inv)
            return []
        self._hand_off(inv, consumer)
        return []

    def _consumer_of(self, inv: Invocation, own_slot: Optional[Invocation]) -> Optional[Invocation]:
        if inv.phase is not Phase.RECOMPUTE:
            return None
        if not inv.replay:
            return own_slot if own_slot is not None and own_slot.state is not State.CLOSED else None
        # Newest first, and only a slot this backward will open: with several forwards before a
        # backward, a newer forward's slots of the same module may belong to another backward.
        unopened = None
        for slot in reversed(self._slots_by_module.get(inv.module, ())):
            if slot.state is State.CLOSED or slot.matched:
                continue
            if slot.state is State.OPEN or self._will_open(slot):
                slot.matched = True
                return slot
            unopened = unopened or slot
        return unopened

    def _hand_off(self, inv: Invocation, slot: Invocation) -> None:
        for param in inv.holds:
            holders = self._holder_set(param)
            holders.discard(inv.id)
            holders.add(slot.id)
            key = (slot.id, param)
            if key in self._handoffs or param not in slot.holds:
                # A repeated hand-off is re-stamped: the running batch references the param now.
                self._handoffs.pop(key, None)
                self._handoffs[key] = self._batch
            slot.holds.add(param)
        inv.holds = set()
        inv.state = State.CLOSED
        del self._live[inv.id]

    def _drop_holds(self, inv: Invocation) -> List[Hashable]:
        freed = self._unhold_all(inv.id, inv.holds)
        if self._handoffs:
            for param in inv.holds:
                self._handoffs.pop((inv.id, param), None)
        inv.holds = set()
        return freed

    def _retire(self, inv: Invocation) -> List[Hashable]:
        freed = self._drop_holds(inv)
        inv.lent.clear()
        self._lending.discard(inv)
        inv.state = State.CLOSED
        self._live.pop(inv.id, None)
        if inv.phase is Phase.BACKWARD:
            slots = self._slots_by_module.get(inv.module)
            if slots is not None:
                slots[:] = [s for s in slots if s.state is not State.CLOSED]
                if not slots:
                    del self._slots_by_module[inv.module]
        return freed

    def _drop_hold(self, slot: Invocation, param: Hashable) -> bool:
        """Drop one hold of a slot and its hand-off; True if the param has no holder left."""
        self._handoffs.pop((slot.id, param), None)
        slot.holds.discard(param)
        return self._unhold(slot.id, param)

    def _unhold(self, inv_id: int, param: Hashable) -> bool:
        """Remove one hold; True if the param has no holder left."""
        return bool(self._unhold_all(inv_id, (param, )))

    def _unhold_all(self, inv_id: int, params: Iterable[Hashable]) -> List[Hashable]:
        """Remove the invocation's hold of each param; returns those with no holder left."""
        held, holder_set, freed = self._held, self._holder_set, []
        for param in params:
            if param in held:
                holders = holder_set(param)
                holders.discard(inv_id)
                if not holders:
                    held.discard(param)
                    freed.append(param)
        return freed

    def _handoff_only_params(self) -> Set[Hashable]:
        params = set()
        for (slot_id, param) in self._handoffs:
            slot = self._live.get(slot_id)
            if slot is None or slot.state is not State.PENDING:
                continue
            if all(self._live[h].state is State.PENDING for h in self.holders(param) if h in self._live):
                params.add(param)
        return params


# ---------------------------------------------------------------- gather units
# Note: [Gather units]
#     A *gather unit* is a module whose hooks gather, hold and release the params of its whole
#     subtree as one: its calls are the only invocations inside it, so a decoder layer costs one
#     fetch, one release and one backward slot per pass instead of one per Linear (a LoRA layer
#     has three). The rules of the invocations are unchanged; a unit is simply the module they see.
#     - A ZeRO-3 leaf that the user marked (``set_z3_leaf_modules``) is always a unit: that is what
#       ZeRO-3 itself makes of it.
#     - Otherwise a *candidate* becomes a unit: by default each activation-checkpointed block (the
#       module a checkpoint wraps), or the modules the user named.
#     - Units do not nest: the outermost wins, since its params include everything inside it.
#     - A candidate is not a unit when its subtree holds more param elements than the live-param
#       budget (``stage3_max_live_parameters``): it could not be gathered at once under it.
#     - A candidate is not a unit when a module inside it also hangs elsewhere in the model (shared
#       by two parents): called from outside the unit, that module would have no hooks to gather it.
#     - A user's leaf inside a unit stays a leaf of ZeRO-3's optimizer: a unit changes how params
#       are gathered and released, and when their gradients enter the reduce bucket (Note: [A unit's
#       gradients enter the reduce bucket together]), never which gradients are reduced together
#       or in what order. Upstream reduces a leaf's
#       params together from the leaf's backward hook, with zeros for params that got no gradient
#       (MoE experts not routed to on this rank), so every rank reduces the same params in the same
#       order. Reduced one by one instead, ranks that ran different experts fill different buckets:
#       a collective size mismatch, or, with experts of one shape, other experts' gradients averaged
#       in silently.
#     What a unit changes in memory: its params stay gathered from its first use in a pass to its
#     last, so the gathered peak grows by at most one unit (FSDP2 holds a layer the same way); the
#     bytes gathered per step do not change (forward, then one gather for recompute and backward).


def choose_gather_units(root: Hashable, children: Callable[[Hashable], Iterable[Hashable]],
                        is_leaf: Callable[[Hashable], bool],
                        is_candidate: Callable[[Hashable], bool], numel_under: Callable[[Hashable], int],
                        parent_count: Callable[[Hashable], int], max_live_numel: int) -> List[Hashable]:
    """The gather units under ``root`` (``root`` included), outermost first, in pre-order.

    ``children`` lists a module's direct children; ``parent_count`` says under how many modules a
    module hangs in the tree of ``root``; ``numel_under`` counts the param elements of a module's
    subtree. See [Gather units].
    """

    def shared_inside(module) -> bool:
        stack = list(children(module))
        while stack:
            inner = stack.pop()
            if parent_count(inner) > 1:
                return True
            stack.extend(children(inner))
        return False

    return _outermost([root], children,
                      lambda module: is_leaf(module) or (is_candidate(module) and numel_under(module) <= max_live_numel
                                                         and not shared_inside(module)))


def leaves_inside(unit: Hashable, children: Callable[[Hashable], Iterable[Hashable]],
                  is_leaf: Callable[[Hashable], bool]) -> List[Hashable]:
    """The outermost leaves strictly below ``unit``, in pre-order: the user's leaves whose gradient
    reduction a gather unit keeps (see [Gather units])."""
    return _outermost(children(unit), children, is_leaf)


def _outermost(tops: Iterable[Hashable], children: Callable[[Hashable], Iterable[Hashable]],
               matches: Callable[[Hashable], bool]) -> List[Hashable]:
    """The modules that ``matches``, at or below ``tops``, that no other match lies above; pre-order."""
    found, seen, stack = [], set(), list(reversed(list(tops)))
    while stack:
        module = stack.pop()
        if module in seen:  # shared: reached again through another parent
            continue
        seen.add(module)
        if matches(module):
            found.append(module)
            continue
        stack.extend(reversed(list(children(module))))
    return found


# ---------------------------------------------------------------- gradient batches
# Note: [A unit's gradients enter the reduce bucket together]
#     ZeRO-3 moves each trainable param's gradient into its reduce bucket from the param's
#     post-accumulate-grad hook, one param at a time: a stream switch, a copy and a
#     ``record_stream`` for each (about 70 Python calls for one LoRA matrix). The fork keeps those
#     hooks and everything they decide (when a bucket is reduced, the expected-hook count, the
#     end-of-backward epilogue) and changes only *when* a gather unit's gradients move: the hook of
#     a unit's param leaves the gradient where ``AccumulateGrad`` put it, and once each of the
#     unit's batched params has its gradient they all move in one copy under one stream switch.
#     - The bucket sees the params in the order their gradients arrived, as on stock: an arrival
#       for anything else (another unit's param, a param in no unit, the end of the backward) moves
#       the pending ones first. The buckets therefore reduce the same params in the same order,
#       on every rank, and the step is stock's to the bit.
#     - A gradient that arrives again for a param still pending (reentrant checkpointing, a unit
#       called twice) was summed into the pending one by ``AccumulateGrad``: it moves once.
#     - At most one unit is pending, and a unit is batched only when its trainable elements fit in
#       one reduce bucket: the gradient memory outside the buckets grows by at most one bucket
#       (LoRA adapters of a decoder layer: a few MB; a fully trained decoder layer is not batched).
#     - A unit whose params do not all get a gradient (a branch the data skipped) moves at the next
#       arrival of anything else, or at the end of the backward.


class GradientBatch:
    """The gradients of one unit that wait to enter the reduce bucket together (see [A unit's
    gradients enter the reduce bucket together]). Params and units are opaque keys."""
    __slots__ = ("unit", "pending", "_arrived", "_missing")

    def __init__(self):
        self.unit = None
        self.pending: List[Hashable] = []
        self._arrived = bytearray()
        self._missing = 0

    def arrive(self, param: Hashable, unit: Optional[Hashable], index: int = 0, size: int = 1) -> List[Hashable]:
        """``param``'s gradient arrived; it is the ``index``-th of the ``size`` batched params of
        ``unit`` (None: of no unit, it moves on its own after what this returns). Returns the
        params whose gradients move into the bucket now, in order."""
        if unit is None:
            return self.take()
        moved = []
        if unit != self.unit:
            moved = self.take()
            self.unit, self._arrived, self._missing = unit, bytearray(size), size
        if self._arrived[index]:
            return moved
        self._arrived[index] = 1
        self.pending.append(param)
        self._missing -= 1
        if not self._missing:
            moved += self.take()
        return moved

    def take(self) -> List[Hashable]:
        """Everything pending, in arrival order; the batch is empty afterwards."""
        pending = self.pending
        self.unit, self.pending, self._arrived, self._missing = None, [], bytearray(), 0
        return pending


# ---------------------------------------------------------------- reuse distance
# Note: [Reuse distance]
#     ZeRO-3 records the order of module fetches in its first step (the trace). Once the trace is
#     complete, a param released at trace position ``p`` stays gathered when a later fetch gathers
#     it again before ``stage3_max_reuse_distance`` param elements have been fetched from ``p`` on
#     (counted fetch by fetch: the fetches from ``p`` up to, not including, the reusing one).
#     What a fetch gathers is *that* module's gather set: a ZeRO-3 leaf's or unit's whole subtree,
#     any other module its own (and external) params. Upstream's ``__params_to_release`` scans the
#     later fetches with the *released* module's leaf flag instead, so the release of a leaf or unit
#     counts every ancestor fetched later (the root's backward, a container's) as a reuse of the
#     whole subtree below it, and the unit stays gathered until the end of the backward (the
#     fuzzer's units under a reentrant checkpoint whose input needs no grad; upstream's own MoE
#     leaves alike). The index below answers the question with each fetch's own set, and in
#     O(log trace) per param rather than a scan of the trace per release.


class TraceReuse:
    """When the trace fetches each param again (see [Reuse distance]).

    ``trace[i]`` lists the ``(param, numel)`` pairs that the fetch at trace position ``i`` gathers.
    """

    def __init__(self, trace: Sequence[Iterable[Tuple[Hashable, int]]]):
        self._elements_before = [0]  # [i]: the param elements the fetches before position i gather
        self._positions: Dict[Hashable, List[int]] = {}  # param -> the positions that fetch it, ascending
        for position, fetched in enumerate(trace):
            elements = 0
            for param, numel in fetched:
                self._positions.setdefault(param, []).append(position)
                elements += numel
            self._elements_before.append(self._elements_before[-1] + elements)

    def __len__(self) -> int:
        return len(self._elements_before) - 1

    def reused_within(self, param: Hashable, position: int, max_elements: int) -> bool:
        """Whether a fetch at ``position`` or later gathers ``param`` before ``max_elements`` param
        elements have been fetched from ``position`` on."""
        positions = self._positions.get(param)
        if not positions:
            return False
        next_use = bisect.bisect_left(positions, position)
        if next_use == len(positions):
            return False
        return self._elements_before[positions[next_use]] - self._elements_before[position] < max_elements
