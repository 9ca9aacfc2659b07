"""runtime/utils.py: the fork's count of the params a running backward reaches is upstream's count."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed.runtime.utils import count_used_parameters_in_backward as upstream_count
from zero3_ac.runtime.utils import count_used_parameters_in_backward as fork_count


def counts_inside_a_backward(params, used, extra):
    """Both counts, taken in a hook of a backward whose loss uses ``used`` (indices into ``params``)
    and the non-leaf tensors ``extra``; ``extra`` joins the counted list."""
    counts = []
    x = torch.ones(2, 3, requires_grad=True)

    def hook(grad):
        counted = params + extra
        counts.append((upstream_count(counted), fork_count(counted)))
        return grad

    loss = (x * 2).sum()
    for index in used:
        loss = loss + params[index].sum()
    for tensor in extra:
        loss = loss + tensor.sum()
    x.register_hook(hook)
    loss.backward()
    return counts[0]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_count_is_upstreams_for_any_mix_of_used_unused_frozen_repeated_and_non_leaf_tensors(data):
    size = data.draw(st.integers(1, 8))
    frozen = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
    params = [torch.nn.Parameter(torch.ones(3), requires_grad=not flag) for flag in frozen]
    params += [params[index] for index in data.draw(st.lists(st.integers(0, size - 1), max_size=3))]  # repeats
    used = data.draw(st.lists(st.integers(0, size - 1), unique=True))
    leaf = torch.ones(3, requires_grad=True)
    extra = [leaf * 3] if data.draw(st.booleans()) else []
    upstream, fork = counts_inside_a_backward(params, used, extra)
    assert fork == upstream


def test_the_count_can_differ_from_the_number_of_params():
    """The check above can fail: the counts depend on which params the backward reaches."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    assert counts_inside_a_backward(params, [0, 2], []) == (2, 2)


def test_outside_a_backward_it_raises_as_upstream_does():
    with pytest.raises(RuntimeError, match="during backward"):
        fork_count([torch.nn.Parameter(torch.ones(1))])
