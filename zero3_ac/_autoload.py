"""Imported by ``zero3_ac.pth`` at interpreter start-up, so keep it cheap: stdlib only.

It applies the fork right after ``deepspeed`` finishes importing, in every process (the
``deepspeed`` launcher's, torchrun's and accelerate's workers included), unless
``ZERO3_AC_DISABLE=1``.
"""

import os
import sys


def _disabled() -> bool:
    return os.environ.get("ZERO3_AC_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def _apply_now():
    from zero3_ac import activation
    activation.auto_apply()


class _ApplyWhenDeepSpeedLoads:
    """A meta-path finder that wraps the loader of the top-level ``deepspeed`` package once."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_stock = spec.loader.exec_module

        def exec_module(module):
            exec_stock(module)
            _apply_now()

        spec.loader.exec_module = exec_module
        return spec


def install():
    if _disabled() or any(isinstance(finder, _ApplyWhenDeepSpeedLoads) for finder in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        _apply_now()
        return
    sys.meta_path.insert(0, _ApplyWhenDeepSpeedLoads())


install()
