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
    """A meta-path finder that wraps the loader of the top-level ``deepspeed`` package.

    Note: ``importlib.util.find_spec("deepspeed")`` (how transformers and accelerate check that
    DeepSpeed is installed) asks this finder too, without ever executing the spec it gets. So the
    finder wraps every spec it is asked for and leaves ``sys.meta_path`` only once DeepSpeed has
    actually been executed.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and not getattr(spec.loader, "_zero3_ac_wrapped", False):
            self._wrap(spec.loader)
        return spec

    def _wrap(self, loader):
        exec_stock = loader.exec_module

        def exec_module(module):
            exec_stock(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _apply_now()

        loader.exec_module = exec_module
        loader._zero3_ac_wrapped = True


def install():
    if _disabled() or any(isinstance(finder, _ApplyWhenDeepSpeedLoads) for finder in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        _apply_now()
        return
    sys.meta_path.insert(0, _ApplyWhenDeepSpeedLoads())


install()
