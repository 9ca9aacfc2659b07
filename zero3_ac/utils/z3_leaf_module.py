"""Gather units as ZeRO-3 leaves: extends upstream ``utils/z3_leaf_module.py``.

The rules that choose the units are invocation_lifecycle's ``choose_gather_units`` (Note:
[Gather units]). Here they meet the model: a unit becomes a ZeRO-3 leaf module for the hooks and
the coordinator (``_z3_leaf``: hooks on the unit only, its fetch recurses into its subtree), but its
params are not marked ``ds_z3_leaf_module``, so the ZeRO-3 optimizer keeps reducing their gradients
one param at a time, exactly as without units.

Note: [Leaf gradients in the ZeRO-3 optimizer]
    For params of a user's leaf module (``ds_z3_leaf_module``), upstream's optimizer reduces the
    gradients from a full backward hook on the leaf, and writes zeros for params whose gradient is
    None then (MoE experts that did not run). A module whose inputs require no grad runs that hook
    when its output gradient arrives, before its param gradients exist. Units keep the per-param
    reduction hooks, which fire when each gradient is there.

A user's leaf inside a unit stays a leaf of the optimizer (its params carry ``ds_z3_leaf_module``),
see [Gather units].

The setting, per model, with the API winning over the config:

- ``zero3_ac.set_gather_units(model, units)`` before ``deepspeed.initialize``;
- the DeepSpeed config's ``"zero3_ac": {"gather_units": units}`` (top level);

``units`` is ``"auto"`` (the default: each block HF checkpoints, ``GradientCheckpointingLayer`` with
gradient checkpointing on, when the engine is created), ``"off"`` (each module, as stock; user
leaves stay leaves), or a list of module class names (``"LlamaDecoderLayer"`` or the qualified
``"transformers.models.llama.modeling_llama.LlamaDecoderLayer"``).
"""

import collections
import sys

from deepspeed.utils import logger, set_z3_leaf_module, z3_leaf_module

from zero3_ac.runtime.zero.invocation_lifecycle import choose_gather_units, leaves_inside

AUTO = "auto"
OFF = "off"
CONFIG_SECTION = "zero3_ac"
CONFIG_KEY = "gather_units"
_API_ATTR = "_zero3_ac_gather_units"
_CONFIG_ATTR = "_zero3_ac_gather_units_config"
_UNIT_MARK = "_zero3_ac_gather_unit"
_markings = [0]  # how many times units were marked in this process: facts computed per unit key on it


def _validated(units, where):
    if units in (AUTO, OFF):
        return units
    if isinstance(units, (list, tuple)) and units and all(isinstance(name, str) and name for name in units):
        return tuple(units)
    raise ValueError(f"zero3_ac: {where} must be \"auto\", \"off\" or a non-empty list of module class names "
                     f"(e.g. [\"LlamaDecoderLayer\"]), got {units!r}")


def set_gather_units(model, units=AUTO):
    """Choose ``model``'s gather units (``"auto"``, ``"off"`` or class names); call before ``deepspeed.initialize``."""
    model.__dict__[_API_ATTR] = _validated(units, "set_gather_units(model, units)")


def remember_config_setting(model, param_dict) -> None:
    """Keep the DeepSpeed config's ``zero3_ac.gather_units`` on ``model`` for the hooks' registration."""
    section = (param_dict or {}).get(CONFIG_SECTION)
    if section is None:
        model.__dict__.pop(_CONFIG_ATTR, None)
        return
    if not isinstance(section, dict):
        raise ValueError(f"zero3_ac: the DeepSpeed config's \"{CONFIG_SECTION}\" section must be a dict such as "
                         f"{{\"{CONFIG_KEY}\": \"off\"}}, got {section!r}")
    if set(section) - {CONFIG_KEY}:
        raise ValueError(f"zero3_ac: the DeepSpeed config's \"{CONFIG_SECTION}\" section takes only "
                         f"\"{CONFIG_KEY}\", got {section!r}")
    if CONFIG_KEY in section:
        model.__dict__[_CONFIG_ATTR] = _validated(section[CONFIG_KEY], f"\"{CONFIG_SECTION}\": {{\"{CONFIG_KEY}\"}}")


def is_gather_unit(module) -> bool:
    """Whether the fork made ``module`` a ZeRO-3 leaf (a user's leaf is not one)."""
    return bool(module.__dict__.get(_UNIT_MARK))


def _is_checkpointed_block(module) -> bool:
    layers = sys.modules.get("transformers.modeling_layers")
    layer_class = getattr(layers, "GradientCheckpointingLayer", None)
    return layer_class is not None and isinstance(module, layer_class) and module.gradient_checkpointing is True


def _class_names(module) -> tuple:
    kind = type(module)
    return kind.__name__, f"{kind.__module__}.{kind.__qualname__}"


def _candidate_test(root, units):
    if units == AUTO:
        return _is_checkpointed_block
    if units == OFF:
        return lambda module: False
    names = set(units)
    present = {name for module in root.modules() for name in _class_names(module)}
    unknown = sorted(names - present)
    if unknown:
        classes = sorted({type(module).__name__ for module in root.modules() if any(True for _ in module.parameters())})
        raise ValueError(f"zero3_ac: gather_units names {unknown}, which no module of the model is; module classes "
                         f"with params in this model: {classes}")
    return lambda module: not names.isdisjoint(_class_names(module))


def mark_gather_units(root, max_live_numel) -> list:
    """Make ``root``'s gather units ZeRO-3 leaves (dropping earlier marks under it); returns them."""
    _markings[0] += 1
    for module in root.modules():
        if module.__dict__.pop(_UNIT_MARK, False):
            set_z3_leaf_module(module, False)
    units = root.__dict__.get(_API_ATTR, root.__dict__.get(_CONFIG_ATTR, AUTO))
    parents = collections.Counter(child for module in root.modules() for child in module.children())
    chosen = choose_gather_units(root,
                                 children=lambda module: list(module.children()),
                                 is_leaf=z3_leaf_module,
                                 is_candidate=_candidate_test(root, units),
                                 numel_under=lambda module: sum(
                                     getattr(param, "ds_numel", param.numel()) for param in module.parameters()),
                                 parent_count=parents.__getitem__,
                                 max_live_numel=max_live_numel)
    new_units = [module for module in chosen if not z3_leaf_module(module)]
    for module in new_units:
        set_z3_leaf_module(module, True)
        module.__dict__[_UNIT_MARK] = True
    if new_units:
        kinds = sorted({type(module).__name__ for module in new_units})
        logger.info(f"zero3_ac: {len(new_units)} gather units ({', '.join(kinds)}); "
                    f"\"{CONFIG_SECTION}\": {{\"{CONFIG_KEY}\": \"{OFF}\"}} gathers module by module")
    return chosen


def markings() -> int:
    """Grows each time units are marked anywhere: what was computed from the units is stale once it changes."""
    return _markings[0]


def user_leaves_at(module) -> list:
    """The user's ZeRO-3 leaves that a hooked leaf ``module`` stands for: itself, or, for a gather
    unit, the outermost leaves inside it, whose params keep the optimizer's leaf reduction."""
    if not is_gather_unit(module):
        return [module]
    return leaves_inside(module, children=lambda inner: list(inner.children()), is_leaf=z3_leaf_module)
