"""When a module tree changes shape: lets a walk of a whole model be computed once.

Note: [Module trees that change shape]
    ZeRO-3 walks the whole model at every step boundary: ``release_and_reset_all`` runs
    ``named_parameters`` over every module twice and ``partition_all_parameters`` once more, three
    walks of a few thousand modules on a LoRA model (``named_modules`` builds a prefixed name for
    each). The list those walks produce changes only when a module gains a param or a child.
    torch calls its global registration hooks (``register_module_parameter_registration_hook``,
    ``register_module_module_registration_hook``) whenever ``setattr``, ``register_parameter``,
    ``add_module`` or ``register_module`` puts a param or a module into any module, so while the fork
    is active it counts those calls, and a cached walk is reused only while the count stands.
    One registration is not counted: a module ZeRO-3 already manages (it has a ``ds_id``) put into a
    container that it does not manage. transformers' decoders iterate over
    ``self.layers[:num_hidden_layers]``, and slicing a ``ModuleList`` registers every layer into a
    new, throwaway ``ModuleList`` in every forward; counting that would forget the walks each step.
    Not counted: writes straight into ``module._parameters`` or ``_modules`` and deletions
    (``del module.weight``), which no hook reports; under ZeRO-3 a param that appears that way is not
    partitioned either. Counting starts with :func:`start_counting` (``apply``) and stops with
    :func:`stop_counting` (``remove``); while it is stopped, nothing cached by :func:`cached_walk` is
    reused.
"""

from torch.nn.modules import module as torch_module

_handles = []
_generation = 0


def generation():
    """The count of registrations seen so far, or ``None`` while nothing is counting them."""
    return _generation if _handles else None


def _param_registered(module, name, param):
    global _generation
    _generation += 1


def _module_registered(module, name, submodule):
    global _generation
    if hasattr(submodule, "ds_id") and not hasattr(module, "ds_id"):
        return  # a managed module listed in a container outside the model (a slice of a ModuleList)
    _generation += 1


def start_counting() -> None:
    """Count every param or module registration in the process (idempotent); forgets older walks."""
    global _generation
    register_param_hook = getattr(torch_module, "register_module_parameter_registration_hook", None)
    register_module_hook = getattr(torch_module, "register_module_module_registration_hook", None)
    if _handles or register_param_hook is None or register_module_hook is None:
        return  # a torch without the global hooks: nothing counts, so every walk is fresh
    _generation += 1
    _handles.append(register_param_hook(_param_registered))
    _handles.append(register_module_hook(_module_registered))


def stop_counting() -> None:
    while _handles:
        _handles.pop().remove()


def cached_walk(module, attribute: str, walk, extra_key=()):
    """``list(walk(module))``, kept in ``module.__dict__[attribute]`` and reused while no param or
    module was registered anywhere since and ``extra_key`` is the same."""
    key = (generation(), extra_key)
    cached = module.__dict__.get(attribute)
    if cached is not None and key[0] is not None and cached[0] == key:
        return cached[1]
    value = list(walk(module))
    module.__dict__[attribute] = (key, value)
    return value
