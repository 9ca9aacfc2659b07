"""Imported by ``zero3_ac.pth`` at every interpreter start-up: stdlib only, and reads no setting.

It puts a finder on ``sys.meta_path`` that applies the fork right after the top-level ``deepspeed``
package has executed, in every process (the ``deepspeed`` launcher's, torchrun's, accelerate's and
multiprocessing's workers included). Nothing of torch, DeepSpeed or ``zero3_ac`` is imported before
``import deepspeed``, so settings a script makes before that import take effect:
``ZERO3_AC_DISABLE=1`` (read by ``zero3_ac.activation.auto_apply``), DeepSpeed's ``DS_ACCELERATOR``,
``CUDA_VISIBLE_DEVICES``.

A top-level module rather than a ``zero3_ac`` submodule, so that start-up does not import the package.
"""

import sys


def _apply_now():
    from zero3_ac import activation
    activation.auto_apply()


def _is_package_module(fullname):
    return fullname == "zero3_ac" or fullname.startswith("zero3_ac.")


class ApplyWhenDeepSpeedLoads:
    """A meta-path finder that wraps the loader of the top-level ``deepspeed`` package, and of the
    package's own modules imported before it.

    Note: [A find_spec that never imports]
        ``importlib.util.find_spec("deepspeed")`` (how transformers and accelerate check that
        DeepSpeed is installed) asks this finder too, without ever executing the spec it gets. So the
        finder wraps every spec it is asked for, answers with the spec the other finders found, and
        leaves ``sys.meta_path`` only once DeepSpeed has actually been executed.

    Note: [DeepSpeed imported by one of the package's modules]
        ``zero3_ac.set_gather_units`` (or any module of the package that needs DeepSpeed) used before
        ``import deepspeed`` imports DeepSpeed from inside that module's own import. Applying the fork
        right then imports the fork's adapters, and those import the half-executed module: its names
        are not there yet, the apply fails, and DeepSpeed runs stock. So while one of the package's
        modules (imported through this finder) is executing, the apply waits until the outermost one
        has finished.
    """

    def __init__(self):
        self._executing = 0  # package modules imported through this finder, executing now
        self._apply_pending = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not _is_package_module(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module") and not getattr(loader, "_zero3_ac_wrapped", False):
            loader.exec_module = (self._package_module if fullname != "deepspeed" else self._deepspeed)(
                loader.exec_module)
            loader._zero3_ac_wrapped = True
        return spec

    def _deepspeed(self, exec_stock):

        def exec_module(module):
            exec_stock(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if self._executing:  # Note [DeepSpeed imported by one of the package's modules]
                self._apply_pending = True
            else:
                _apply_now()

        return exec_module

    def _package_module(self, exec_stock):

        def exec_module(module):
            self._executing += 1
            try:
                exec_stock(module)
            finally:
                self._executing -= 1
                if self._apply_pending and not self._executing:
                    self._apply_pending = False
                    _apply_now()

        return exec_module


def install() -> None:
    """Apply the fork when ``deepspeed`` is imported (now, if it already was). Idempotent."""
    if any(isinstance(finder, ApplyWhenDeepSpeedLoads) for finder in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        _apply_now()
        return
    sys.meta_path.insert(0, ApplyWhenDeepSpeedLoads())


install()
