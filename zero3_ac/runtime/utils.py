"""ZeRO-3's count of the params a running backward reaches, with less host work per param: replaces
upstream ``runtime/utils.py``'s ``count_used_parameters_in_backward`` in ``runtime/zero/stage3.py``.

Upstream's count runs at the first gradient hook of every backward (and, before 0.19.3, at every
hook): for each trainable param it opens ``torch.enable_grad()`` twice and calls torch's
``_get_grad_fn_or_grad_acc``, some ten Python calls around the one ``view_as`` that finds a leaf's
gradient accumulator. This does the same per param under one ``enable_grad`` for the whole loop:
the same nodes, so the same count.
"""

import torch

from deepspeed.runtime import utils as upstream


def count_used_parameters_in_backward(parameters) -> int:
    """The number of ``parameters`` whose gradient nodes the running backward will execute."""
    if not upstream.check_internal_apis_for_count_used_parameters() or torch._C._current_graph_task_id() == -1:
        return upstream.count_used_parameters_in_backward(parameters)  # raises as upstream does
    nodes = set()
    with torch.enable_grad():
        for param in parameters:
            if isinstance(param, torch.Tensor) and param.requires_grad:
                node = param.grad_fn
                nodes.add(node if node is not None else param.view_as(param).grad_fn.next_functions[0][0])
    return sum(map(torch._C._will_engine_execute_node, nodes))
