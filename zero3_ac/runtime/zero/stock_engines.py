"""ZeRO-3 engines that the fork leaves to stock DeepSpeed: the mark the adapters consult.

Which engines and why: Note [Engines left to stock] in ``zero3_ac/runtime/engine.py``. The decision
is made once per engine, in ``DeepSpeedEngine._configure_zero_optimizer``, and recorded on each
object through which a patched method is reached:

- the engine's ``DeepSpeedZeRoOffload``: its hooks' registration (and so everything keyed on
  ``lifecycle_hooks``, which stays None for it);
- its stage 3 optimizer: the gradient-partition wrappers (``stage3_gradients``);
- its params: ZeRO-3's linear, which sees nothing of the engine but its inputs.
"""

import contextlib
import contextvars

LEFT_TO_STOCK_ATTR = "_zero3_ac_left_to_stock"
_configuring_stock_engine = contextvars.ContextVar("zero3_ac_configuring_stock_engine", default=False)


@contextlib.contextmanager
def configuring_stock_engine():
    """Around the creation of the optimizer and offload of an engine left to stock."""
    token = _configuring_stock_engine.set(True)
    try:
        yield
    finally:
        _configuring_stock_engine.reset(token)


def left_to_stock(obj) -> bool:
    """Whether ``obj`` (a stage 3 optimizer, or a param) belongs to an engine left to stock.

    ``getattr``, not the instance dict: Dynamo traces this inside ZeRO-3's linear under
    ``torch.compile``, and reads a tensor's attributes but not its ``__dict__``.
    """
    return getattr(obj, LEFT_TO_STOCK_ATTR, False)


def offload_left_to_stock(offload) -> bool:
    """Whether ``offload`` belongs to an engine left to stock: decided at its first hooks'
    registration, which its constructor runs while its engine is being configured."""
    left = offload.__dict__.get(LEFT_TO_STOCK_ATTR)
    if left is None:
        left = offload.__dict__[LEFT_TO_STOCK_ATTR] = _configuring_stock_engine.get()
    return left


def mark(objects, left: bool) -> None:
    """Record on ``objects`` whether their engine is left to stock (a model's params may be reused
    by a later engine, so the mark is also cleared)."""
    for obj in objects:
        if left:
            obj.__dict__[LEFT_TO_STOCK_ATTR] = True
        else:
            obj.__dict__.pop(LEFT_TO_STOCK_ATTR, None)
