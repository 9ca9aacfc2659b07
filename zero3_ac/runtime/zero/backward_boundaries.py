"""Where a forward call's backward starts and ends: the autograd boundaries that ``parameter_offload``'s
module hooks put around a call's outputs and grad-requiring inputs, and the data of one backward slot.

Note: [When a call's backward starts and ends]
    Each forward call whose outputs require grad gets a backward slot (see invocation_lifecycle).
    - It opens in the backward of an identity Function wrapped around each output: autograd runs
      it before any node of the call's own backward, because those nodes consume its gradient.
    - It closes when the call's input gradients are done: every grad-requiring input goes through
      an identity Function of its own, so that its gradient is this call's alone (an input shared
      with other modules would otherwise wait for them too), and a multi-grad hook in "all" mode
      fires once the gradients that this graph task will compute for them are computed. Inputs
      whose gradient the task never computes are skipped by the hook, not waited for. The
      identity Function of a call's only grad-requiring input closes the slot itself (Note [One
      grad-requiring input]).
    - A call with no grad-requiring input (a LoRA adapter fed a frozen layer's output) has no
      input gradient to wait for: its backward is done when the trainable params under the module
      have their gradients accumulated, and a post-accumulate-grad hook closes it then.
    Upstream counts inputs per module (``ds_grads_remaining``), which a second call of the module
    or a checkpoint recompute resets in the middle of a backward.

Note: [Slots a backward never reaches]
    An output that requires grad but that nothing differentiated depends on (an extra output the
    caller drops, an aux head's unused logits) never receives a gradient, so its call's slot never
    opens. Each slot keeps weak references to the autograd nodes that would open it; a replay
    recompute asks ``torch._C._will_engine_execute_node`` whether the running graph task will run
    any of them before handing its params to that slot. The graph task is the one that consumes
    the replay's tensors, so the answer is for the right backward, reentrant nesting included.

Note: [What a module's forward sees]
    The hooks wrap a call's grad-requiring inputs (and outputs) in identity Functions in the
    forward but not in a replay recompute, whose graph is thrown away. Wrapping must keep the
    aliasing of the call's arguments: a tensor passed twice (``nn.MultiheadAttention`` self-
    attention: ``query is key is value``) is wrapped once, so ``is`` holds in both passes. torch
    picks code paths by such identities, and a checkpoint recompute that takes another path saves
    a different number of tensors (``CheckpointError``). Stock wraps separately in both passes.
"""

import torch


class OpenSlotOnGrad(torch.autograd.Function):
    """The identity on one output of a call; its backward opens the call's slot."""

    @staticmethod
    def forward(ctx, hooks, slot, tensor):
        ctx.hooks = hooks
        ctx.slot = slot
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.hooks.open_slot(ctx.slot)
        return None, None, grad


class _SlotCloser:
    """What an input's boundary node closes in its backward: the slot of a call with one grad-requiring
    input, once it exists and until it is removed as a multi-grad hook's handle would be. It holds no
    tensor, so the node that holds it keeps nothing of the call alive."""
    __slots__ = ("hooks", "slot")

    def __init__(self):
        self.hooks = self.slot = None

    def remove(self):
        self.slot = None


class _GradBoundary(torch.autograd.Function):
    """The identity on one grad-requiring input of a call; its backward closes a call's only slot."""

    @staticmethod
    def forward(ctx, closer, tensor):
        ctx.closer = closer
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):
        closer = ctx.closer
        if closer.slot is not None:
            closer.hooks.close_slot(closer.slot)
        return None, grad


class SlotContext:
    """Driver data of one backward slot: the nodes that open it, the trainable params it awaits,
    and the multi-grad hook on its call's inputs."""
    __slots__ = ("open_nodes", "awaited_params", "awaiting_grads", "input_hook")

    def __init__(self, awaited_params=(), input_hook=None):
        self.open_nodes = []
        self.awaited_params = tuple(awaited_params)
        self.awaiting_grads = set(awaited_params)
        self.input_hook = input_hook

    def will_open(self) -> bool:
        for ref in self.open_nodes:
            node = ref()
            if node is not None and torch._C._will_engine_execute_node(node):
                return True
        return False

    def reachable(self) -> bool:
        """Whether a node that opens the slot is still alive (see parameter_offload.py [A slot lives as long
        as its graph])."""
        return any(ref() is not None for ref in self.open_nodes)

    def await_only_computed_grads(self):
        """Keep waiting only for the gradients the running backward will accumulate.

        Note: [Gradients a backward will not compute]
            A call's trainable params do not all get a gradient from every backward: MoE experts
            the router did not pick on this rank, a branch the data skipped. A slot that waited
            for them would stay open to the end of the backward, its params gathered. When the
            slot opens, inside the backward, ``torch._C._will_engine_execute_node`` says which
            params' ``AccumulateGrad`` nodes this graph task runs; the slot waits for those.
            ``param.view_as(param).grad_fn.next_functions[0][0]`` is the node the graph holds
            (torch keeps a weak reference to it per param), or, for a param outside the graph, a
            new one that dies at once. A node must not be kept beyond that: it records the
            param's shape when it is made, and ZeRO-3's partitioned shape is ``[0]``. A slot
            whose params all drop out keeps waiting for them all: nothing of its call is left for
            the backward to run, and the end of the backward releases it.
        """
        with torch.enable_grad():  # a backward runs with grad mode off: no grad_fn, no node
            computed = {
                param for param in self.awaiting_grads
                if torch._C._will_engine_execute_node(param.view_as(param).grad_fn.next_functions[0][0])
            }
        if computed:
            self.awaiting_grads = computed


def slot_will_open(slot) -> bool:
    return slot.context is None or slot.context.will_open()


class InputBoundary:
    """The grad-requiring inputs of one forward call, and the slot they close once it exists."""
    __slots__ = ("wrapped", "slot", "closer", "_by_id")

    def __init__(self):
        self.wrapped = []
        self.slot = None
        self.closer = _SlotCloser()
        self._by_id = {}

    def wrap(self, tensor):
        """One wrapper per distinct tensor (see [What a module's forward sees])."""
        if not tensor.requires_grad:
            return tensor
        wrapped = self._by_id.get(id(tensor))
        if wrapped is None:
            wrapped = self._by_id[id(tensor)] = _GradBoundary.apply(self.closer, tensor)
            self.wrapped.append(wrapped)
        return wrapped

    def close_slot_when_done(self, hooks, slot):
        """Make the call's inputs close ``slot`` once the backward has computed their gradients.

        Note: [One grad-requiring input]
            A call with one grad-requiring input (a decoder layer's hidden states) needs no
            multi-grad hook: its gradient is done when autograd runs the input's boundary node, so
            that node's backward closes the slot (the ``_SlotCloser`` it holds), as a multi-grad
            hook over the one tensor would, in the same node. The closer stands in for the hook's
            handle: removing it disarms it. Several inputs get torch's multi-grad hook in "all" mode
            (see [When a call's backward starts and ends]). Returns the handle, which the caller must
            remove.
        """
        self.slot = slot
        if len(self.wrapped) == 1:
            self.wrapped, self._by_id = None, None
            self.closer.hooks, self.closer.slot = hooks, slot
            return self.closer
        return self._multi_grad_hook(hooks)

    def _multi_grad_hook(self, hooks):
        """Register the multi-grad hook; returns its handle, which the caller must remove.

        Note: [Removing the input hooks]
            The "all"-mode multi-grad hook keeps the inputs' autograd nodes in its closure, and
            the nodes keep the hook: a cycle through C++ that the garbage collector cannot see,
            so every call's boundary would outlive the step. The drain removes the handles.
        """
        # Keep no tensor here: the hook lives on those tensors, and a cycle through them would
        # keep this call's activations alive until the garbage collector runs.
        tensors, self.wrapped, self._by_id = self.wrapped, None, None
        return torch.autograd.graph.register_multi_grad_hook(tensors,
                                                             lambda grads: self.slot and hooks.close_slot(self.slot),
                                                             mode="all")
