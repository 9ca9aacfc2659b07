"""Leave no process group and no shm buffer behind: ``with process_groups_destroyed_at_exit(): main()``.

Training or failing, a launched example's rank destroys torch.distributed's groups and DeepSpeed's
references to them, so that the interpreter exits normally, atexit handlers (wandb, Hub uploads,
log flushing) included (Note: [Process groups at interpreter exit] in zero3_ac/utils/spawn.py), and
removes the shm all-reduce buffer it created (Note: [DeepSpeed's shm all-reduce buffers], same file).
"""

import contextlib

from zero3_ac.utils.spawn import finish_rank


@contextlib.contextmanager
def process_groups_destroyed_at_exit():
    """Run the block (``main()``: the trainer and its engine are gone when it returns), then clean up the rank."""
    try:
        yield
    finally:
        finish_rank()
