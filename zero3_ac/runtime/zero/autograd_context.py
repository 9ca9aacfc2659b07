"""Where a ZeRO-3 module hook is running, as far as autograd can tell."""

import torch

# Note: [Recompute and replay]
#     ``torch._C._current_graph_task_id()`` is -1 outside a backward. A module forward that runs
#     inside a backward graph task is an activation-checkpoint recompute; reentrant checkpoints
#     recompute inside backward too. What differs is who consumes the recomputed activations:
#     - a *replay* recompute (torch's non-reentrant checkpoint, selective checkpointing, and
#       ``deepspeed.checkpointing.non_reentrant_checkpoint``) runs under a saved-tensors pack hook
#       that hands every saved tensor to the *original* forward graph, and throws its own graph
#       away. Its module hooks must not wrap outputs for a backward that will never run, and its
#       params belong to the original call's backward slot. Non-grad tensors such as frozen
#       params are saved as live, undetached references, and torch compares their shape after
#       the recompute: an in-place ZeRO release before that check is the historical
#       ``CheckpointError: ... shape [N] vs [0]``.
#     - a reentrant recompute runs with no saved-tensors hook; its graph is backpropagated right
#       away by a nested ``torch.autograd.backward``, so it behaves like a forward.
_REPLAY_PACK_HOOKS = ("_recomputation_hook.", "replay_pack")


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def is_replay_recompute() -> bool:
    """True inside a recompute whose saved tensors feed the original forward's graph."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return False
    qualname = getattr(hooks[0], "__qualname__", "")
    return any(marker in qualname for marker in _REPLAY_PACK_HOOKS)


def queue_end_of_backward_callback(callback) -> None:
    """Run ``callback`` when the graph task of the backward now executing finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
