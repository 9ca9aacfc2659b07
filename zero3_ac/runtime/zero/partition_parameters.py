"""Debug printing in the hot path, ``GatheredParameters`` around a param a module holds, and the blocking
gather of several params on gloo: extends upstream ``partition_parameters.py`` (and ``stage3.py``'s
``print_rank_0``).

Note: [Debug printing that prints nothing]
    ZeRO-3's ``print_rank_0(message, debug=False, force=False)`` (one in ``partition_parameters.py``,
    one in ``stage3.py``) asks the process group for the rank before it looks at ``debug`` and
    ``force``, and is called several times for every param partitioned: about 500 releases a step
    on a LoRA model, each paying a ``dist.get_rank()`` to print nothing. The replacement looks at
    the flags first; what it prints, and where, is upstream's.

Note: [A context that gathers what a module holds]
    ``GatheredParameters(params, fwd_module=module)`` registers ``params`` as external params of
    ``module``, gathers them, and partitions them at its exit; DeepSpeed's docs show it inside
    ``module``'s forward, gathering a child's weight for another child. From the second forward on,
    ``module``'s own fetch has gathered those params before its forward runs (they are its external
    params now) and the running call holds them, so the context's exit partitions params in use:
    upstream's ``free_param`` raises ``Cannot free a ZeRO-3 parameter while it is still active``.
    The same happens to any context opened inside a forward on params a running module holds.
    The context does not hold what it gathers beyond its exit, so it has no say over params others
    hold: its exit partitions the params no live invocation holds and leaves the others to their
    holders, which release them when their calls are done. A context that broadcasts an update
    (``modifier_rank``) to held params is refused with the fix named: writing the update into the
    partition means releasing a param its holder is still using.

Note: [A blocking gather of several params waits for each]
    ``Init._allgather_params_coalesced``, the blocking gather of several params (``GatheredParameters``
    on two or more partitioned params, ``_post_step``'s gather of the persistent params after every
    ``step()``, checkpoint loading), starts one ``async_op=True`` all-gather per param, waits for the
    last handle only, and points each param's data at its output buffer. NCCL runs the collectives in
    order on one stream, so the last one done means all are; gloo runs asynchronous work on worker
    threads in no order, and the accelerator's ``synchronize`` is a no-op on CPU. So on gloo with two
    or more ranks the params before the last can be read before their data has arrived: half-written
    or uninitialised values (an update of 1e27 in one rank, a reference model one step off, seen in
    this repo's CPU runs on DeepSpeed 0.18.5), on stock as on the fork. DeepSpeed 0.19.8 waits for
    every handle (upstream's comment names gloo); 0.18.5 and 0.19.2 do not. On those, the wrapper
    has each all-gather the call starts wait for its work before it returns the handle, so nothing in
    the call (the dequantization of quantized weights included) or after it reads an unfinished
    buffer. On NCCL that wait only orders the streams.
"""

import contextlib


def print_rank_0_checking_flags_first(stock):
    """A ``print_rank_0`` that calls ``stock`` only when it would print (``debug`` or ``force``)."""

    def print_rank_0(message, debug=False, force=False):
        if debug or force:
            stock(message, debug=debug, force=force)

    print_rank_0.__doc__ = stock.__doc__
    return print_rank_0


_HELD_AND_MODIFIED = (
    "zero3_ac: GatheredParameters(modifier_rank={rank}) exits on params that a running module still holds "
    "(ds_id {ids}: its own params, or external params it registered, e.g. with fwd_module=...). ZeRO-3 can write "
    "an update into a param's partition only by releasing the param, which the module is still using. Modify them "
    "outside the engine's forward and backward (before the forward, or between steps), or leave them unmodified "
    "and use modifier_rank=None.")


def _held(params) -> list:
    return [param for param in params if param.ds_active_sub_modules]


def _refuse_held_and_modified(context, held) -> None:
    if context.src_rank is not None:
        raise RuntimeError(_HELD_AND_MODIFIED.format(rank=context.src_rank, ids=[param.ds_id for param in held]))


def params_to_partition_leaving_held_ones(context, stock):
    """Wraps ``GatheredParameters._params_to_partition`` (0.19.8): what the context's exit partitions,
    less the params a live invocation holds (Note [A context that gathers what a module holds])."""
    params = stock(context)
    held = _held(params)
    if not held:
        return params
    _refuse_held_and_modified(context, held)
    return [param for param in params if not param.ds_active_sub_modules]


def exit_leaving_held_params(context, stock, *exc):
    """Wraps ``GatheredParameters.__exit__`` where it partitions ``self.params`` itself (0.18.5, 0.19.2):
    the exit leaves the params a live invocation holds to their holders."""
    held = _held(context.params) if context.enabled else []
    if not held:
        return stock(context, *exc)
    _refuse_held_and_modified(context, held)
    every_param = context.params
    context.params = [param for param in every_param if not param.ds_active_sub_modules]
    try:
        return stock(context, *exc) if context.params else None
    finally:
        context.params = every_param


# The first release read to wait for every handle; before it (0.18.5 and 0.19.2 read, 0.19.3-0.19.7 not read) the
# wrapper is installed: waiting for a handle twice is harmless.
WAITS_FOR_EACH_FROM = "0.19.8"


def coalesced_gather_waits_for_last_only() -> bool:
    """Whether the installed DeepSpeed's ``_allgather_params_coalesced`` needs the wrapper below."""
    from packaging.version import Version

    from zero3_ac import version_guard
    return Version(version_guard.installed_deepspeed_version()) < Version(WAITS_FOR_EACH_FROM)


# The gathers ``_allgather_params_coalesced`` starts, on both paths of upstream's code (``use_all_gather_into_tensor``
# or not), through its module's ``dist`` (``deepspeed.comm``).
_ALL_GATHERS = ("all_gather_into_tensor", "all_gather")


@contextlib.contextmanager
def _all_gathers_done_when_they_return():
    """Inside the block ``deepspeed.comm``'s all-gathers wait for the work they start before they return it."""
    from deepspeed import comm

    def waiting(stock):
        def all_gather(*args, **kwargs):
            handle = stock(*args, **kwargs)
            if handle is not None:
                handle.wait()
            return handle

        return all_gather

    saved = {name: getattr(comm, name) for name in _ALL_GATHERS}
    for name, stock in saved.items():
        setattr(comm, name, waiting(stock))
    try:
        yield
    finally:
        for name, stock in saved.items():
            setattr(comm, name, stock)


def allgather_params_coalesced_waiting_for_each(init, stock, param_list, *args, **kwargs):
    """Wraps ``Init._allgather_params_coalesced`` where it waits for the last all-gather only (0.18.5, 0.19.2):
    each all-gather the call starts is done before the call reads its output, the dequantization of
    quantized weights included (Note [A blocking gather of several params waits for each])."""
    with _all_gathers_done_when_they_return():
        return stock(init, param_list, *args, **kwargs)
