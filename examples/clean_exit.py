"""Leave no process group to the interpreter's shutdown: ``with process_groups_destroyed_at_exit(): main()``.

Note: [Process groups at interpreter exit] in zero3_ac/self_test.py says why. Training or failing,
a launched example destroys torch.distributed's groups before the interpreter exits.
"""

import contextlib


def destroy_process_groups():
    """Destroy the default process group and every group made from it, if there is one (idempotent)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_groups_destroyed_at_exit():
    """Run the block, then destroy the process groups whether it returned or raised; after a block
    that returned, leave without the interpreter's finalization, where a gloo thread can abort."""
    try:
        yield
    finally:
        destroy_process_groups()
    from zero3_ac.self_test import exit_without_finalizing
    exit_without_finalizing(0)
