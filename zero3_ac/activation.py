"""Installing the fork into DeepSpeed's ZeRO-3 classes, and taking it out again.

The fork replaces methods on upstream classes, so it covers every engine created while it is
active. Engines created before :func:`apply` keep stock hooks (their module hooks are already
registered); engines created while it was active keep the fork's hooks after :func:`remove`.

Note: [Changes that reach beyond ZeRO-3]
    :func:`apply` patches only what ZeRO-3 alone runs (its offload, coordinator, optimizer, linear
    and debug printing) plus four ``DeepSpeedEngine`` wrappers that act only on ZeRO-3 setups. The
    changes that every engine or module in the process would see wait until the fork takes over the
    first ZeRO-3 engine's modules (:func:`_process_wide_patches`, torch's module registration
    hooks in ``module_tree``): a process that only runs ZeRO-0/1/2 or inference engines keeps
    DeepSpeed's NVTX ranges, its accelerator's ``current_stream`` and torch's module registration
    untouched. docs/side-effects.md lists every change.
"""

import os
import threading

from zero3_ac import version_guard

DISABLE_ENV = "ZERO3_AC_DISABLE"

_lock = threading.Lock()
_originals = {}
_process_wide = []  # True once the process-wide changes are in (see [Changes that reach beyond ZeRO-3])
_INHERITED = object()  # a patched name the owner did not define itself (it came from a base class)


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def is_active() -> bool:
    return bool(_originals)


def _wrapping(owner, name, fork_function):
    """A patch of ``owner.name`` that calls ``fork_function(self, stock_method, *args, **kwargs)``."""

    def method(self, *args, **kwargs):
        return fork_function(self, _originals[(owner, name)], *args, **kwargs)

    return owner, name, method


def _patches():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
    from deepspeed.runtime.zero import parameter_offload as stock_parameter_offload
    from deepspeed.runtime.zero import partition_parameters as stock_partition_parameters
    from deepspeed.runtime.zero import partitioned_param_coordinator as stock_coordinator
    from deepspeed.runtime.zero import stage3 as stock_stage3
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from zero3_ac.runtime import engine as fork_engine
    from zero3_ac.runtime import utils as fork_utils
    from zero3_ac.runtime.comm import coalesced_collectives as fork_coalesced_collectives
    from zero3_ac.runtime.zero import borrowed_params
    from zero3_ac.runtime.zero import coalesced_copy_out
    from zero3_ac.runtime.zero import linear as fork_linear
    from zero3_ac.runtime.zero import partition_parameters as fork_partition_parameters
    from zero3_ac.runtime.zero import partitioned_param_coordinator as fork_coordinator
    from zero3_ac.runtime.zero import parameter_offload as fork
    from zero3_ac.runtime.zero import stage3 as fork_stage3
    from zero3_ac.runtime.zero import stage3_grad_norm
    from zero3_ac.runtime.zero import stage3_gradients
    from zero3_ac.runtime.zero import stage3_partition_groups
    from zero3_ac.runtime.zero import stage3_sub_group_gradients
    from zero3_ac.runtime.zero import stock_engines

    def _register_deepspeed_module(self, stock, module, *args, **kwargs):
        if stock_engines.offload_left_to_stock(self):
            return stock(self, module, *args, **kwargs)
        _start_process_wide_changes()
        fork.register_deepspeed_module(self, module)

    patches = [
        (LinearFunctionForZeroStage3, "apply", classmethod(fork_linear.apply)),
        _wrapping(DeepSpeedZeRoOffload, "_register_deepspeed_module", _register_deepspeed_module),
        (stock_parameter_offload, "register_external_parameter", borrowed_params.register_external_parameter),
        *((module, "iter_params", fork_coordinator.cached_iter_params)
          for module in (stock_coordinator, stock_parameter_offload)),
        *((module, "print_rank_0", fork_partition_parameters.print_rank_0_checking_flags_first(module.print_rank_0))
          for module in (stock_partition_parameters, stock_stage3)),
        _wrapping(DeepSpeedZeRoOffload, "partition_all_parameters", fork.partition_all_parameters),
        _wrapping(stock_partition_parameters.AllGatherCoalescedHandle, "wait", coalesced_copy_out.wait),
        _wrapping(DeepSpeedZeroOptimizer_Stage3, "initialize_ds_offload", fork_stage3.initialize_ds_offload),
        _wrapping(DeepSpeedZeroOptimizer_Stage3, "step", fork_stage3.step),
        _wrapping(DeepSpeedEngine, "compile", fork_engine.compile),
        _wrapping(DeepSpeedEngine, "_configure_zero_optimizer", fork_engine.configure_zero_optimizer),
        _wrapping(DeepSpeedEngine, "_forward_prologue", fork_engine.forward_prologue),
        _wrapping(DeepSpeedEngine, "_forward_epilogue", fork_engine.forward_epilogue),
        (LinearFunctionForZeroStage3, "forward", fork_linear.replacement_forward(LinearFunctionForZeroStage3)),
        (stock_stage3, "count_used_parameters_in_backward", fork_utils.count_used_parameters_in_backward),
        (stock_stage3, "reduce_scatter_coalesced", fork_coalesced_collectives.reduce_scatter_coalesced),
        *(_wrapping(DeepSpeedZeroOptimizer_Stage3, name, getattr(stage3_gradients, name))
          for name in ("reduce_ready_partitions_and_remove_grads", "partition_grads",
                       "independent_gradient_partition_epilogue", "zero_grad")),
        _wrapping(DeepSpeedZeroOptimizer_Stage3, "_prepare_fp32_grad_for_sub_group",
                  stage3_sub_group_gradients.prepare_fp32_grad_for_sub_group),
        _wrapping(DeepSpeedZeroOptimizer_Stage3, "get_grad_norm_direct", stage3_grad_norm.get_grad_norm_direct),
    ]
    if "finalize_gradient_accumulation_boundary" in DeepSpeedZeroOptimizer_Stage3.__dict__:  # 0.19.8+
        patches.append(_wrapping(DeepSpeedZeroOptimizer_Stage3, "finalize_gradient_accumulation_boundary",
                                 stage3_gradients.finalize_gradient_accumulation_boundary))
    for name in ("_assert_same_partition_group", "_autoep_expert_parallel_group"):  # 0.19.3+
        if name in DeepSpeedZeroOptimizer_Stage3.__dict__:
            patches.append(_wrapping(DeepSpeedZeroOptimizer_Stage3, name,
                                     getattr(stage3_partition_groups, name.lstrip("_"))))
    if "_params_to_partition" in GatheredParameters.__dict__:
        patches.append(_wrapping(GatheredParameters, "_params_to_partition",
                                 fork_partition_parameters.params_to_partition_leaving_held_ones))
    else:
        patches.append(_wrapping(GatheredParameters, "__exit__", fork_partition_parameters.exit_leaving_held_params))
    if fork_partition_parameters.coalesced_gather_waits_for_last_only():
        patches.append(_wrapping(stock_partition_parameters.Init, "_allgather_params_coalesced",
                                 fork_partition_parameters.allgather_params_coalesced_waiting_for_each))
    if "release_backward_leftovers" in DeepSpeedZeRoOffload.__dict__:
        patches.append(_wrapping(DeepSpeedZeRoOffload, "release_backward_leftovers", fork.release_backward_leftovers))
    return patches


def _process_wide_patches():
    """What every engine in the process sees: applied with the first ZeRO-3 engine the fork takes over."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.utils import nvtx as stock_nvtx
    from zero3_ac.accelerator import cuda_accelerator as fork_cuda_accelerator
    from zero3_ac.utils import nvtx

    patches = [(CUDA_Accelerator, "current_stream", fork_cuda_accelerator.current_stream)]
    if not nvtx.ranges_requested():
        patches.append((stock_nvtx, "enable_nvtx", False))
    return patches


def _install(patches) -> None:
    for owner, name, replacement in patches:
        _originals[(owner, name)] = owner.__dict__.get(name, _INHERITED)
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)


def _start_process_wide_changes() -> None:
    """Called as the fork takes over a ZeRO-3 engine's modules: the first time, make the process-wide changes."""
    if _process_wide:
        return
    from zero3_ac.utils import module_tree
    with _lock:
        if _process_wide or not _originals:
            return
        _install(_process_wide_patches())
        module_tree.start_counting()
        _process_wide.append(True)


def _existing_engines() -> int:
    from deepspeed.runtime.zero import parameter_offload
    return len(parameter_offload.FWD_MODULE_STACK)


def apply() -> None:
    """Install the per-invocation lifecycle into DeepSpeed's ZeRO-3 engine. Idempotent."""
    version = version_guard.check_supported()
    from deepspeed.utils import logger
    with _lock:
        if _originals:
            return
        _install(_patches())
        existing = _existing_engines()
    if not version_guard.is_supported(version):
        logger.warning(version_guard.untested_warning(version))
    if existing:
        logger.warning(f"zero3_ac: applied to deepspeed {version} after {existing} ZeRO-3 engine(s) were created; "
                       "those keep stock behaviour, engines created from now on use the per-invocation lifecycle.")
    else:
        logger.info(f"zero3_ac: per-invocation ZeRO-3 lifecycle active on deepspeed {version}")


def remove() -> None:
    """Restore DeepSpeed's own methods exactly. Engines created meanwhile keep the fork's hooks."""
    from zero3_ac.utils import module_tree
    with _lock:
        module_tree.stop_counting()
        _process_wide.clear()
        for (owner, name), original in _originals.items():
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _originals.clear()


def auto_apply() -> None:
    """Called when DeepSpeed is imported in a process where the package is installed."""
    if disabled_by_env():
        return
    version = version_guard.installed_deepspeed_version()
    from deepspeed.utils import logger
    if not version_guard.can_apply(version):
        logger.warning(version_guard.unsupported_message(version) + " zero3_ac left DeepSpeed unchanged.")
        return
    try:
        apply()
    except Exception as error:  # never break ``import deepspeed``
        logger.warning(f"zero3_ac: could not apply the lifecycle, DeepSpeed runs stock: {error!r}")
