"""Which partition group a run of the optimizer's own params reduces over, answered from facts about all
of them taken once: extends upstream ``stage3.py`` (``_assert_same_partition_group`` and
``_autoep_expert_parallel_group``, 0.19.3+).

Note: [Partition-group checks over the optimizer's own params]
    Upstream asks two questions of every run of params it reduces or takes the norm of: do they
    share one partition group (``_assert_same_partition_group``, which raises if not), and are they
    all AutoEP experts (``_autoep_expert_parallel_group``, which returns the expert-parallel group
    then, None otherwise). Each asks every param again, in a Python generator: in one LoRA step at
    1.1B, the reduce, the reduce-scatter and the norm ask about each of the 308 trainable params,
    about 8 Python calls a param (2,400 a step) that give the same answer every step.

    A param's partition group (``ds_process_group``, set when ``zero.Init`` partitions it) and its
    AutoEP family (``ds_zero_placement_family``, set before the optimizer is built) do not change
    afterwards. So the fork asks once, over every param of the optimizer's ``fp16_groups``: if they
    share one group, any run of them does, and the check has nothing to raise; if none is an AutoEP
    expert, no run of them is all experts, and the answer is None. A run holding any param that is
    not the optimizer's (told apart by identity, in one C-level set operation), or an optimizer whose
    params mix groups or hold experts, gets upstream's answer, asked of each param.
"""

_FACTS = "_zero3_ac_partition_group_facts"
_EXPERT_FAMILY = "autoep_expert"


class _Facts:
    """The ids of an optimizer's params, and what holds for every one of them."""
    __slots__ = ("count", "ids", "one_group", "no_experts")

    def __init__(self, optimizer, count):
        params = [param for group in optimizer.fp16_groups for param in group]
        self.count = count
        self.ids = frozenset(map(id, params))
        groups = [optimizer._get_param_partition_group(param) for param in params]
        self.one_group = all(group == groups[0] for group in groups)
        self.no_experts = all(getattr(param, "ds_zero_placement_family", None) != _EXPERT_FAMILY for param in params)


def _facts(optimizer) -> _Facts:
    """Taken again while the optimizer's constructor is still adding sub-groups (it checks each one)."""
    count = sum(map(len, optimizer.fp16_groups))
    facts = optimizer.__dict__.get(_FACTS)
    if facts is None or facts.count != count:
        facts = optimizer.__dict__[_FACTS] = _Facts(optimizer, count)
    return facts


def assert_same_partition_group(optimizer, stock, params):
    """Wraps ``_assert_same_partition_group``: see [Partition-group checks over the optimizer's own params]."""
    facts = _facts(optimizer)
    if facts.one_group and facts.ids.issuperset(map(id, params)):
        return None
    return stock(optimizer, params)


def autoep_expert_parallel_group(optimizer, stock, params):
    """Wraps ``_autoep_expert_parallel_group``: see [Partition-group checks over the optimizer's own params]."""
    facts = _facts(optimizer)
    if facts.no_experts and facts.ids.issuperset(map(id, params)):
        return None
    return stock(optimizer, params)
