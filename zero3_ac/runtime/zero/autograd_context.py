"""Where a ZeRO-3 module hook is running, as far as autograd can tell."""

import contextlib

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

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

# Note: [ZeRO's own ops inside a selective checkpoint]
#     Selective checkpointing (``create_selective_checkpoint_contexts``) runs the region's forward
#     under a torch dispatch mode that logs every op, and replays that log in the recompute: the
#     k-th call of an op in the recompute gets the k-th entry of the forward. ZeRO-3's gathers and
#     releases are ops too (``aten.empty`` for a released param's placeholder, the all-gather's
#     buffers and views), and the recompute needs not do the same ones as the forward: the
#     forward may find a param prefetched or kept for reuse, the recompute may release one that
#     nothing consumes. Then torch raises ``aten.empty.memory_format encountered during backward
#     but not found in storage``. ZeRO's gathers and releases are not the model's computation, so
#     the hooks run them with the selective-checkpoint modes taken off the dispatch stack.
_SELECTIVE_CHECKPOINT_MODES = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def graph_task_id() -> int:
    return torch._C._current_graph_task_id()


def _top_pack_hook():
    """The pack hook of the innermost saved-tensors hooks, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else hooks[0]


def saved_tensors_hooks_active() -> bool:
    """Whether any saved-tensors hooks are installed (a replay recompute always runs under one)."""
    return _top_pack_hook() is not None


def is_replay_recompute() -> bool:
    """True inside a recompute whose saved tensors feed the original forward's graph."""
    qualname = getattr(_top_pack_hook(), "__qualname__", "")
    return any(marker in qualname for marker in _REPLAY_PACK_HOOKS)


# The pack hooks of a checkpointed region's forward (whose saved tensors are dropped) and of its
# recompute (whose saved tensors feed this backward): torch's, and DeepSpeed's non_reentrant_checkpoint.
_CHECKPOINT_PACK_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.", "checkpoint_pack", "replay_pack")


# A pack hook's qualified name -> whether it is a checkpoint's: asked at every linear call, and the
# names are a handful of functions.
_is_checkpoint_pack_hook = {}


def inside_checkpoint() -> bool:
    """Inside an activation-checkpointed region, forward or recompute, or inside a reentrant recompute.

    A reentrant checkpoint's forward runs under ``no_grad`` and its recompute inside the backward
    with no saved-tensors hook; a non-reentrant one's forward and recompute run under their pack hooks.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return torch._C._current_graph_task_id() != -1
    qualname = getattr(hooks[0], "__qualname__", "")
    try:
        return _is_checkpoint_pack_hook[qualname]
    except KeyError:
        found = _is_checkpoint_pack_hook[qualname] = any(marker in qualname for marker in _CHECKPOINT_PACK_HOOKS)
        return found


def outside_selective_checkpoint():
    """A context in which ops are not seen by an enclosing selective checkpoint."""
    if any(isinstance(mode, _SELECTIVE_CHECKPOINT_MODES) for mode in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


def queue_end_of_backward_callback(callback) -> None:
    """Run ``callback`` when the graph task of the backward now executing finishes."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# Note: [Which region a read belongs to, and when its recompute is done]
#     torch's non-reentrant checkpoint runs a region's forward under a pack hook that closes over
#     the region's ``_CheckpointFrame``; the frame records, per graph task, whether the region has
#     been recomputed (``is_recomputed``), and lives as long as the region's saved tensors do. A
#     recompute re-runs the region's code; the tensors its ops save wait in the frame
#     (``recomputed``, frozen params as themselves, undetached) until the op's backward unpacks
#     them. A tensor saved outside any region, or a view of it (a linear saves ``weight.t()``),
#     holds a C++ reference to its TensorImpl instead, which ``Tensor._use_count`` counts; Python
#     references to the tensor object do not count there. So a param is still needed by a region's
#     ops exactly while the frame holds it or its TensorImpl has a reference beyond its own object.
#     Anything else (DeepSpeed's own checkpoint, a user's saved-tensors hooks inside the region,
#     a torch without these internals) is not recognised, and callers must then assume the worst.
_CHECKPOINT_FORWARD_PACK_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"


def running_checkpoint_region():
    """The frame of the torch non-reentrant checkpoint whose forward is running, or None."""
    pack = _top_pack_hook()
    if getattr(pack, "__qualname__", "") != _CHECKPOINT_FORWARD_PACK_HOOK:
        return None
    cells = dict(zip(pack.__code__.co_freevars, pack.__closure__ or ()))
    frame = cells["frame"].cell_contents if "frame" in cells else None
    return frame if isinstance(getattr(frame, "is_recomputed", None), dict) else None


def recompute_done_and_consumed(frame, tensor) -> bool:
    """Whether the backward now executing has recomputed the region of ``frame``, and has unpacked
    every tensor of it that is ``tensor`` itself."""
    gid = graph_task_id()
    if not frame.is_recomputed.get(gid, False):
        return False
    waiting = getattr(frame, "recomputed", {}).get(gid)
    return not waiting or all(saved is not tensor for saved in waiting.values())


def referenced_only_by_itself(tensor) -> bool:
    """Whether nothing but its own Python object references the tensor (no saved tensor, no view);
    False where torch cannot tell."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count is not None and use_count() == 1
