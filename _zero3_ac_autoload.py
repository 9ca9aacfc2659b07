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


class ApplyWhenDeepSpeedLoads:
    """A meta-path finder that wraps the loader of the top-level ``deepspeed`` package.

    Note: [A find_spec that never imports]
        ``importlib.util.find_spec("deepspeed")`` (how transformers and accelerate check that
        DeepSpeed is installed) asks this finder too, without ever executing the spec it gets. So the
        finder wraps every spec it is asked for, answers with the spec the other finders found, and
        leaves ``sys.meta_path`` only once DeepSpeed has actually been executed.
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


def install() -> None:
    """Apply the fork when ``deepspeed`` is imported (now, if it already was). Idempotent."""
    if any(isinstance(finder, ApplyWhenDeepSpeedLoads) for finder in sys.meta_path):
        return
    if "deepspeed" in sys.modules:
        _apply_now()
        return
    sys.meta_path.insert(0, ApplyWhenDeepSpeedLoads())


install()
