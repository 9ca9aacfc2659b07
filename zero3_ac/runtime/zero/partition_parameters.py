"""Debug printing in the hot path: extends upstream ``partition_parameters.py`` (and ``stage3.py``).

Note: [Debug printing that prints nothing]
    ZeRO-3's ``print_rank_0(message, debug=False, force=False)`` (one in ``partition_parameters.py``,
    one in ``stage3.py``) asks the process group for the rank before it looks at ``debug`` and
    ``force``, and is called several times for every param partitioned: about 500 releases a step
    on a LoRA model, each paying a ``dist.get_rank()`` to print nothing. The replacement looks at
    the flags first; what it prints, and where, is upstream's.
"""


def print_rank_0_checking_flags_first(stock):
    """A ``print_rank_0`` that calls ``stock`` only when it would print (``debug`` or ``force``)."""

    def print_rank_0(message, debug=False, force=False):
        if debug or force:
            stock(message, debug=debug, force=force)

    print_rank_0.__doc__ = stock.__doc__
    return print_rank_0
