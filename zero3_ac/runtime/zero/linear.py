"""ZeRO-3's memory-efficient linear without in-place writes: replaces the forward of upstream
``runtime/zero/linear.py``'s ``LinearFunctionForZeroStage3``.

Note: [Selective checkpointing and an in-place bias]
    Upstream's forward computes ``output = input.matmul(weight.t())`` and then ``output += bias``
    for inputs that are not 2-d. torch's selective checkpointing
    (``create_selective_checkpoint_contexts``) caches the outputs of the ops its policy saves, as
    detached aliases, and hands the cached tensor back when the recompute runs the same op. For a
    3-d input, ``matmul`` is ``mm`` followed by ``_unsafe_view``, which shares the storage but not
    the version counter, so torch's check for mutated cache entries does not see the ``+=``: the
    cache holds ``mm + bias``, the recompute adds the bias a second time, and every gradient behind
    that linear is silently wrong. (For a 1-d input torch's check does see it: a RuntimeError.)

    The fork's forward writes nothing in place: the bias is fused into ``addmm`` on the input
    flattened to 2-d, as ``torch.nn.functional.linear`` itself does (so a policy written for plain
    torch sees the same ops). It allocates no more than upstream's, and the memory benefit (the
    param itself is saved for backward, so its release frees the gathered weight) is unchanged.

Note: [torch's own linear inside a checkpoint]
    ZeRO-3's linear exists for memory: torch's linear saves ``weight.t()``, a view that keeps the
    gathered storage alive after ZeRO-3 releases the param, up to the backward; ZeRO-3's Function
    saves the param itself, whose release frees it. Inside an activation-checkpointed region that
    reason is gone: the region's forward keeps no saved tensor (a non-reentrant checkpoint's pack
    hook keeps only metadata, a reentrant one runs under ``no_grad``), and its recompute runs in
    the backward that consumes it, while the lifecycle holds the params gathered until that call's
    backward is done. There the fork calls torch's linear, for three reasons:
    - no Python autograd Function per call: ``Function.apply`` binds the arguments through
      ``inspect.signature`` on every call (``setup_context`` style), and its backward is Python;
    - the recompute saves a view, not the param: a release between the recompute and the check
      at its end cannot change what torch compares (``CheckpointError ... [N] vs [0]``);
    - the backward reads the values gathered for it and never gathers again.
    The choice depends only on where the call runs, so a region's forward and its recompute take
    the same path and save the same tensors. Outside checkpointed regions (a forward with grad
    and no checkpoint) ZeRO-3's Function is kept. The branch sits in the Function's ``apply``, so
    ``zero3_linear_wrap`` (which DeepSpeed 0.19.3+ installs as ``torch.nn.functional.linear`` at
    ``initialize``, earlier releases inside ``zero.Init``) and ``LinearModuleForZeroStage3`` both take it.

Note: [Function.apply's binding]
    ``torch.autograd.Function.apply`` of a Function that defines ``setup_context`` (upstream's, from
    0.19.1) first binds the call's arguments to the signature of ``forward`` with
    ``inspect.signature``, some fifty Python calls, to fill in defaults; then, with no functorch
    transform active, it unwraps dead functorch wrappers and calls the C ``apply``. The fork always
    passes all three arguments (``bias`` as None where there is none), so the binding returns them
    unchanged: outside functorch transforms it makes the same unwrapping and the same C call
    directly. Under a transform it calls ``Function.apply`` itself.

For a weight of an engine left to stock (Note [Engines left to stock] in ``runtime/engine.py``), the
Function's ``apply`` and ``forward`` are upstream's.
"""

import torch
from deepspeed.runtime.zero import linear as upstream
from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

from zero3_ac.runtime.zero import autograd_context
from zero3_ac.runtime.zero.stock_engines import LEFT_TO_STOCK_ATTR, left_to_stock


def forward(input, weight, bias=None):
    """The forward of ``LinearFunctionForZeroStage3``: ``input @ weight.T + bias``, out of place."""
    if bias is None:
        return input.matmul(weight.t())
    if input.dim() == 2:
        return torch.addmm(bias, input, weight.t())
    flat = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
    return flat.view(*input.shape[:-1], weight.shape[0])


_FUNCTION_APPLY = torch.autograd.Function.apply.__func__
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def apply(linear_function, input, weight, bias=None):
    """``LinearFunctionForZeroStage3.apply`` (a classmethod): torch's linear inside a checkpointed region,
    ZeRO-3's Function elsewhere (see [torch's own linear inside a checkpoint])."""
    # left_to_stock(weight), and torch.nn.functional.linear as it was before ZeRO-3 replaced it (whatever
    # wrapped it before), inlined: every linear call of the model comes here.
    stock_weight = getattr(weight, LEFT_TO_STOCK_ATTR, False)
    if (autograd_context.inside_checkpoint() or not torch.is_grad_enabled()) and not stock_weight:
        return getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", torch._C._nn.linear)(input, weight, bias)
    if torch._C._are_functorch_transforms_active():
        return _FUNCTION_APPLY(linear_function, input, weight, bias)
    # Function.apply without its argument binding: every argument is passed (see [Function.apply's binding]).
    return super(torch.autograd.Function, linear_function).apply(
        _unwrap_if_dead(input), _unwrap_if_dead(weight), bias if bias is None else _unwrap_if_dead(bias))


def replacement_forward(linear_function):
    """The fork's forward in the calling convention of this DeepSpeed's ``LinearFunctionForZeroStage3``,
    upstream's for a weight of an engine left to stock.

    0.19.1 and later save the inputs in a separate ``setup_context``; earlier releases save them in
    ``forward(ctx, ...)`` itself, under DeepSpeed's autocast decorator.
    """
    stock_forward = linear_function.__dict__["forward"].__func__
    if "setup_context" in linear_function.__dict__:

        def forward_unless_stock(input, weight, bias=None):
            if left_to_stock(weight):
                return stock_forward(input, weight, bias)
            return forward(input, weight, bias)

        return staticmethod(forward_unless_stock)

    @upstream.autocast_custom_fwd
    def forward_saving_inputs(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        return forward(input, weight, bias)

    def forward_saving_inputs_unless_stock(ctx, input, weight, bias=None):
        if left_to_stock(weight):
            return stock_forward(ctx, input, weight, bias)
        return forward_saving_inputs(ctx, input, weight, bias)

    return staticmethod(forward_saving_inputs_unless_stock)
