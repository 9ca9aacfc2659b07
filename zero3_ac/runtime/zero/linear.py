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
"""

import torch


def forward(input, weight, bias=None):
    """The forward of ``LinearFunctionForZeroStage3``: ``input @ weight.T + bias``, out of place."""
    if bias is None:
        return input.matmul(weight.t())
    if input.dim() == 2:
        return torch.addmm(bias, input, weight.t())
    flat = torch.addmm(bias, input.reshape(-1, input.shape[-1]), weight.t())
    return flat.view(*input.shape[:-1], weight.shape[0])


def replacement_forward(linear_function):
    """The fork's forward in the calling convention of this DeepSpeed's ``LinearFunctionForZeroStage3``.

    0.19.1 and later save the inputs in a separate ``setup_context``; earlier releases save them in
    ``forward(ctx, ...)`` itself, under DeepSpeed's autocast decorator.
    """
    if "setup_context" in linear_function.__dict__:
        return staticmethod(forward)
    from deepspeed.runtime.zero import linear as upstream

    @upstream.autocast_custom_fwd
    def forward_saving_inputs(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        return forward(input, weight, bias)

    return staticmethod(forward_saving_inputs)
