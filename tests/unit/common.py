"""CPU multi-rank test harness.

    from tests.unit.common import run_distributed

    def _check(x):                      # module-level, so it pickles by reference
        import deepspeed.comm as dist
        ...
        return dist.get_rank()

    def test_something():
        assert run_distributed(2, _check, 3) == [0, 1]

``run_distributed(world_size, fn, *args, timeout=600, **kwargs)`` runs
``fn(*args, **kwargs)`` on ``world_size`` gloo ranks (``DS_ACCELERATOR=cpu``) and
returns the per-rank results (index = rank).

Design
------
* One persistent pool of ``spawn``-ed worker processes per world size, created
  lazily and reused for the whole session; ``shutdown_pools()`` ends them (the
  conftest calls it at session end, and it is registered with ``atexit``).
* Each worker gets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_SIZE/MASTER_ADDR/
  MASTER_PORT/DS_ACCELERATOR in its environment *from interpreter start-up*
  (so ``zero3_ac.pth`` already sees them), inherits the rest of the parent's
  environment as it is at pool creation (e.g. ZERO3_AC_DISABLE set by
  ``--stock``), then runs ``deepspeed.init_distributed(dist_backend="gloo")``
  once and serves calls.
* After each call a worker runs ``gc.collect()`` and, only if the call
  succeeded on that rank, ``dist.barrier()``.
* Any failure (a rank raised, a worker died, the call timed out) kills and
  discards the whole pool -- the next call gets a fresh one -- and raises
  ``DistributedTestError`` in the caller. Its message holds the exception type
  name and remote traceback of the first failing rank, plus what every other
  rank was doing (stacks of ranks stuck inside ``fn`` are dumped with
  faulthandler). After the first error the other ranks get up to
  ``ERROR_GRACE_S`` seconds to finish, unless they are already known to be
  waiting in the post-call barrier.

Rules for ``fn``: a module-level function (pickled by reference) whose module
is importable in the workers (``tests.unit....`` modules are, since the
workers get the parent's ``sys.path``); arguments and results must be
picklable (plain ``pickle``: tensors are copied, never shared between ranks);
``timeout`` is reserved for run_distributed; ``fn`` must not destroy the
default process group. State left in a worker by one call (module globals,
monkeypatches, DeepSpeed singletons) is visible to later calls on the same
pool.

Knobs (environment): ZERO3_AC_TEST_ERROR_GRACE (default 5 s) and
ZERO3_AC_TEST_CALL_TIMEOUT (one call, default 600 s; scripts/stock_table.py lowers it,
since stock DeepSpeed can hang a rank in a collective), ZERO3_AC_TEST_INIT_TIMEOUT (pool
start-up incl. a first comm-op build, default
600 s) are read by the parent at import; ZERO3_AC_TEST_PRELOAD (comma-separated
modules, e.g. "transformers,peft") is imported by each worker at start-up,
before ``gc.freeze()``, which keeps the per-call ``gc.collect()`` cheap for
heavy imports too.
"""

import atexit
import contextlib
import faulthandler
import gc
import glob
import importlib
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import multiprocessing
from multiprocessing import connection as mp_connection

from zero3_ac.utils import spawn

__all__ = ["run_distributed", "shutdown_pools", "DistributedTestError", "DistributedTestTimeout"]

ERROR_GRACE_S = float(os.environ.get("ZERO3_AC_TEST_ERROR_GRACE", "5"))
INIT_TIMEOUT_S = float(os.environ.get("ZERO3_AC_TEST_INIT_TIMEOUT", "600"))
CALL_TIMEOUT_S = float(os.environ.get("ZERO3_AC_TEST_CALL_TIMEOUT", "600"))
SHUTDOWN_GRACE_S = 5.0
MASTER_ADDR = "127.0.0.1"

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


class DistributedTestError(RuntimeError):
    """A run_distributed call failed on at least one rank.

    Attributes: ``rank`` (first failing rank or None), ``exc_type`` (its
    exception type name), ``remote_traceback`` (its formatted traceback),
    ``remote_exception`` (the exception object itself when it could be pickled,
    else None), ``errors`` ({rank: (type name, traceback)} for every rank that
    failed).
    """

    def __init__(self, message, rank=None, exc_type=None, remote_traceback=None, remote_exception=None,
                 errors=None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.remote_exception = remote_exception
        self.errors = dict(errors or {})


class DistributedTestTimeout(DistributedTestError):
    """A run_distributed call (or pool start-up) ran past its timeout."""


# --------------------------------------------------------------------------- worker side


def _die_with_parent(parent_pid):
    """Linux: SIGKILL this worker when the parent dies, so a killed pytest never leaves ranks behind."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        return
    if os.getppid() != parent_pid:  # parent already gone before prctl
        os._exit(1)


@contextlib.contextmanager
def _fd_capture(path):
    """Send fds 1 and 2 (Python and C level, subprocesses too) to ``path``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    saved = [os.dup(1), os.dup(2)]
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _send(conn, msg):
    try:
        data = pickle.dumps(msg, protocol=_PICKLE_PROTOCOL)
    except Exception:
        assert msg[0] == "ok"
        msg = ("err", "PicklingError",
               "run_distributed: the result of fn could not be pickled:\n" + traceback.format_exc(), None)
        data = pickle.dumps(msg, protocol=_PICKLE_PROTOCOL)
    conn.send_bytes(data)


def _error_msg(exc):
    """("err", type name, formatted traceback, (module, pickled exception) or None)."""
    tb = traceback.format_exc()
    try:
        blob = pickle.dumps(exc, protocol=_PICKLE_PROTOCOL)
        pickle.loads(blob)  # must round-trip (exceptions with custom __init__ often do not)
        exc_info = (type(exc).__module__, blob)
    except Exception:
        exc_info = None
    return ("err", type(exc).__name__, tb, exc_info)


def _load_remote_exception(exc_info):
    """Unpickle a worker's exception object, but only if its module is already imported here
    (never import deepspeed & co. into the pytest process as a side effect of a failure)."""
    if exc_info is None:
        return None
    module, blob = exc_info
    if module not in sys.modules:
        return None
    try:
        return pickle.loads(blob)
    except Exception:
        return None


def _worker_main(conn, rank, env, parent_pid, stack_file, init_log):
    os.environ.update(env)  # already inherited at spawn; repeated for clarity
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it kills the pool
    stack_fh = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)

    try:
        with _fd_capture(init_log):
            import torch.distributed as dist
            import deepspeed
            deepspeed.init_distributed(dist_backend="gloo")
            for module in os.environ.get("ZERO3_AC_TEST_PRELOAD", "").split(","):
                if module.strip():
                    importlib.import_module(module.strip())
            # Move everything imported so far out of the collector's reach: the
            # per-call gc.collect() then costs ~0 ms instead of ~80 ms (torch +
            # deepspeed are ~200k tracked objects). Objects created by calls stay
            # collectable.
            gc.collect()
            gc.freeze()
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        msg = _error_msg(exc)
        try:
            with open(init_log, errors="replace") as fh:
                out = fh.read()
        except OSError:
            out = ""
        msg = (msg[0], msg[1], msg[2] + ("\n--- worker output during init ---\n" + out if out else ""), msg[3])
        _send(conn, msg)
        conn.close()
        return

    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:  # shutdown request
            break
        try:
            fn, args, kwargs = pickle.loads(data)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            reply = _error_msg(exc)
        gc.collect()
        ok = reply[0] == "ok"
        _send(conn, ("done", ok))  # tells the parent this rank left fn
        if ok:
            try:
                dist.barrier()
            except BaseException as exc:  # noqa: BLE001
                reply = _error_msg(exc)
        _send(conn, reply)
        del reply

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)  # skip interpreter/process-group teardown, which can block on dead peers


# --------------------------------------------------------------------------- parent side


def _fn_name(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _Pool:

    def __init__(self, world_size):
        self.world_size = world_size
        self.owner_pid = os.getpid()
        self.port = spawn.free_port(MASTER_ADDR)
        self.tmpdir = tempfile.mkdtemp(prefix=f"zero3ac-ws{world_size}-")
        self.procs = []
        self.conns = []
        self.closed = False
        ctx = multiprocessing.get_context("spawn")
        threads = str(max(1, (os.cpu_count() or 1) // world_size))
        try:
            for rank in range(world_size):
                env = {
                    "DS_ACCELERATOR": "cpu",
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_SIZE": str(world_size),
                    "CROSS_RANK": "0",
                    "CROSS_SIZE": "1",
                    "MASTER_ADDR": MASTER_ADDR,
                    "MASTER_PORT": str(self.port),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
                }
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main,
                                   args=(child_conn, rank, env, os.getpid(), self._stack_file(rank),
                                         self._init_log(rank)),
                                   name=f"zero3ac-ws{world_size}-rank{rank}",
                                   daemon=False)
                with spawn.environment(env):
                    proc.start()
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _stack_file(self, rank):
        return os.path.join(self.tmpdir, f"stack.{rank}")

    def _init_log(self, rank):
        return os.path.join(self.tmpdir, f"init.{rank}.log")

    def healthy(self):
        return not self.closed and self.owner_pid == os.getpid() and all(p.is_alive() for p in self.procs)

    def _wait_ready(self):
        deadline = time.monotonic() + INIT_TIMEOUT_S
        waiting = set(range(self.world_size))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stacks = self._dump_stacks(waiting)
                raise DistributedTestTimeout(
                    f"run_distributed: world_size={self.world_size} pool did not start within {INIT_TIMEOUT_S:.0f}s "
                    f"(ranks {sorted(waiting)} still in deepspeed import/init_distributed){stacks}")
            objs = {}
            for r in waiting:
                objs[self.conns[r]] = r
                objs[self.procs[r].sentinel] = r
            for obj in mp_connection.wait(list(objs), remaining):
                r = objs[obj]
                if r not in waiting:
                    continue
                msg = self._recv(r)
                if msg is None:
                    self.procs[r].join(1)
                    raise DistributedTestError(
                        f"run_distributed: world_size={self.world_size} pool: rank {r} died during start-up "
                        f"(exitcode {self.procs[r].exitcode}){self._read_init_log(r)}",
                        rank=r, exc_type="WorkerDied")
                if msg[0] == "ready":
                    waiting.discard(r)
                else:
                    _, name, tb, exc = msg
                    raise DistributedTestError(
                        f"run_distributed: world_size={self.world_size} pool: rank {r} failed during "
                        f"deepspeed import/init_distributed with {name}:\n{tb}",
                        rank=r, exc_type=name, remote_traceback=tb, remote_exception=exc, errors={r: (name, tb)})

    def _read_init_log(self, rank):
        try:
            with open(self._init_log(rank), errors="replace") as fh:
                out = fh.read().strip()
        except OSError:
            return ""
        return f"\n--- rank {rank} output during init ---\n{out}" if out else ""

    def _recv(self, rank):
        """Next message from ``rank``, or None if its pipe is closed/broken (worker dead)."""
        conn = self.conns[rank]
        try:
            if not (self.procs[rank].is_alive() or conn.poll()):
                return None
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            msg = pickle.loads(data)
        except Exception:
            return ("err", "UnpicklingError",
                    f"run_distributed: could not unpickle the reply of rank {rank} in the parent:\n" +
                    traceback.format_exc(), None)
        if msg[0] == "err":
            msg = msg[:3] + (_load_remote_exception(msg[3]), )
        return msg

    def _dump_stacks(self, ranks):
        """faulthandler stack dumps of live ``ranks`` (SIGUSR1), as text for an error message."""
        ranks = [r for r in sorted(ranks) if self.procs[r].is_alive()]
        if not ranks:
            return ""
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        # faulthandler writes from its C signal handler, i.e. at once even if the rank is blocked in C++.
        def read(r):
            try:
                with open(self._stack_file(r), errors="replace") as fh:
                    return fh.read()
            except OSError:
                return ""

        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not all(read(r) for r in ranks):
            time.sleep(0.02)
        time.sleep(0.1)
        return "".join(f"\n--- rank {r} stack when killed ---\n{read(r).strip() or '(no stack dump)'}"
                       for r in ranks)

    def call(self, fn, args, kwargs, timeout):
        payload = pickle.dumps((fn, args, kwargs), protocol=_PICKLE_PROTOCOL)  # errors here leave the pool intact
        ws = self.world_size
        name = _fn_name(fn)
        try:
            for r in range(ws):
                try:
                    self.conns[r].send_bytes(payload)
                except OSError as exc:
                    self.kill()
                    raise DistributedTestError(
                        f"run_distributed({name}, world_size={ws}): could not send the call to rank {r} "
                        f"(worker dead?): {exc!r}", rank=r, exc_type="WorkerDied") from None
            return self._collect(name, timeout)
        except DistributedTestError:
            raise
        except BaseException:  # e.g. KeyboardInterrupt, pytest-timeout: replies are in flight, pool unusable
            self.kill()
            raise

    def _collect(self, name, timeout):
        ws = self.world_size
        start = time.monotonic()
        deadline = start + timeout
        results = [None] * ws
        pending = set(range(ws))  # no final reply yet
        in_barrier = set()  # left fn successfully, now waiting in the post-call barrier
        failures = {}  # rank -> (type name, traceback, exception object or None)
        order = []  # ranks in the order their failures arrived
        first_failure_t = None

        while pending:
            now = time.monotonic()
            if failures:
                undecided = pending - in_barrier
                if not undecided:
                    break  # everyone else is stuck in the barrier waiting for the failed ranks
                limit = min(deadline, first_failure_t + ERROR_GRACE_S)
            else:
                limit = deadline
            if now >= limit:
                break
            objs = {}
            for r in pending:
                objs[self.conns[r]] = r
                objs[self.procs[r].sentinel] = r
            for obj in mp_connection.wait(list(objs), limit - now):
                r = objs[obj]
                while r in pending:
                    if not (self.conns[r].poll() or not self.procs[r].is_alive()):
                        break
                    msg = self._recv(r)
                    if msg is None:
                        self.procs[r].join(1)
                        code = self.procs[r].exitcode
                        failures[r] = ("WorkerDied", f"worker process of rank {r} died (exitcode {code}) "
                                       f"while running {name}\n", None)
                        order.append(r)
                        pending.discard(r)
                    elif msg[0] == "done":
                        if msg[1]:
                            in_barrier.add(r)
                    elif msg[0] == "ok":
                        results[r] = msg[1]
                        pending.discard(r)
                    else:  # ("err", type name, traceback, exception or None)
                        failures[r] = (msg[1], msg[2], msg[3])
                        order.append(r)
                        pending.discard(r)
                    if failures and first_failure_t is None:
                        first_failure_t = time.monotonic()

        if not pending and not failures:
            return results

        # ---- failure: describe every rank, kill the pool, raise
        elapsed = time.monotonic() - start
        stuck_in_fn = sorted(pending - in_barrier)
        stacks = self._dump_stacks(stuck_in_fn)
        self.kill()

        lines = []
        for r in range(ws):
            if r in failures:
                lines.append(f"rank {r}: raised {failures[r][0]}")
            elif r in in_barrier:
                lines.append(f"rank {r}: finished fn, was waiting in the post-call barrier (killed)")
            elif r in pending:
                lines.append(f"rank {r}: still running fn after {elapsed:.1f}s (killed)")
            else:
                lines.append(f"rank {r}: ok")
        status = "\n".join("  " + line for line in lines)

        if not failures:
            raise DistributedTestTimeout(
                f"run_distributed({name}, world_size={ws}) timed out after {timeout:g}s; pool discarded.\n"
                f"{status}{stacks}")

        first = order[0]
        exc_type, tb, exc_obj = failures[first]
        others = "".join(f"\n--- rank {r} traceback ({failures[r][0]}) ---\n{failures[r][1].rstrip()}"
                         for r in order[1:])
        timed_out = " (call timeout reached)" if time.monotonic() >= deadline else ""
        raise DistributedTestError(
            f"run_distributed({name}, world_size={ws}): rank {first} raised {exc_type}{timed_out}; "
            f"pool discarded.\n{status}\n"
            f"--- rank {first} traceback ({exc_type}) ---\n{tb.rstrip()}{others}{stacks}",
            rank=first,
            exc_type=exc_type,
            remote_traceback=tb,
            remote_exception=exc_obj,
            errors={r: failures[r][:2]
                    for r in order})

    def close(self):
        """Graceful shutdown: ask workers to exit, kill whatever is left."""
        if self.closed:
            return
        if self.owner_pid == os.getpid():
            for conn in self.conns:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self):
        if self.closed:
            return
        self.closed = True
        if self.owner_pid != os.getpid():  # inherited through fork: not ours to kill
            return
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(10)
        for conn in self.conns:
            conn.close()
        spawn.remove_shm_buffers(self.port, MASTER_ADDR)  # Note: [DeepSpeed's shm all-reduce buffers]
        for path in glob.glob(os.path.join(self.tmpdir, "*")):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(self.tmpdir)
        except OSError:
            pass


_POOLS = {}
_LOCK = threading.RLock()


def _get_pool(world_size):
    pool = _POOLS.get(world_size)
    if pool is not None and not pool.healthy():
        pool.kill()
        del _POOLS[world_size]
        pool = None
    if pool is None:
        pool = _Pool(world_size)
        _POOLS[world_size] = pool
    return pool


def run_distributed(world_size: int, fn, *args, timeout: float = CALL_TIMEOUT_S, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks (DS_ACCELERATOR=cpu) and return the per-rank
    results (index = rank). If any rank raises, raise an exception in the caller whose message contains
    the remote traceback of the first failing rank (and its exception type name, e.g. 'CheckpointError')."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if getattr(fn, "__qualname__", "").find("<locals>") >= 0 or getattr(fn, "__name__", "") == "<lambda>":
        raise TypeError(f"fn must be a module-level function (it is pickled by reference), got {_fn_name(fn)}")
    with _LOCK:
        pool = _get_pool(world_size)
        try:
            return pool.call(fn, args, kwargs, timeout)
        finally:
            if pool.closed and _POOLS.get(world_size) is pool:
                del _POOLS[world_size]


def shutdown_pools():
    """Stop every worker pool of this process (they are recreated on demand)."""
    with _LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        for pool in pools:
            pool.close()


atexit.register(shutdown_pools)
