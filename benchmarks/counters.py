"""Deterministic per-step counters of a ZeRO-3 LoRA step on CPU, and their baseline.

    python benchmarks/counters.py              # count, compare with the baseline, exit 1 on a rise over 5%
    python benchmarks/counters.py --update     # count, write the counts as this DeepSpeed version's baseline
    python benchmarks/counters.py --runs 3     # count in 3 fresh processes; they must agree
    python benchmarks/counters.py --world-size 2   # rank 0's counts at two gloo ranks (baseline key "VERSION@2")

The workload of the CPU peer benchmark (``workload.py``: the tiny Llama, PEFT LoRA r16 on every linear
layer, HF non-reentrant checkpointing, AdamW, ZeRO-3 with every param partitioned), world size 1 (gloo),
in a fresh process (``--world-size N``: N fresh processes, rank 0's counts; the partition group is then
more than one rank, so gathers are all-gathers), the fork unless ``ZERO3_AC_DISABLE=1``. After ``WARMUP_STEPS`` steps (the model walks
cached, the optimizer's state built), one step runs under ``sys.setprofile`` and the next one with
``torch.Tensor`` methods wrapped:

- ``python_calls_per_layer``: Python function calls (profile "call" events; a generator's resumption counts)
  in the step, divided by the number of decoder layers; ``zero_python_calls_per_layer``: those of functions
  defined in DeepSpeed or ``zero3_ac``.
- ``zero_torch_calls_per_layer``: calls of torch functions and ``Tensor`` methods from DeepSpeed's or the fork's
  code (seen by a ``TorchFunctionMode``; C work such as a ``narrow``, a ``torch.cat`` or a ``record_stream``, which
  a Python profile does not see), per decoder layer, in a third step;
- ``hook_registrations``: ``Tensor.register_hook`` and ``Tensor.register_post_accumulate_grad_hook`` calls
  in the step; ``param_hooks``: hooks attached to the params after it (both kinds).
- ``record_stream``: ``Tensor.record_stream`` calls; ``to_calls``: ``Tensor.to`` calls from Python;
  ``zero_to_calls``: those made by DeepSpeed or ``zero3_ac`` code.

Counts do not depend on the host's speed, so a rise of more than ``TOLERANCE`` over the baseline of the
installed DeepSpeed version (benchmarks/baselines/counters-cpu.json) is a regression of the hot path;
tests/benchmarks/test_counters.py checks it. Where torch, transformers or peft differ from the versions
the baseline was taken with, only the counters of DeepSpeed's and the fork's own code are compared.
"""

import argparse
import filecmp
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT_PACKAGE = os.path.join(os.path.dirname(HERE), "zero3_ac")
BASELINE = os.path.join(HERE, "baselines", "counters-cpu.json")
TOLERANCE = 0.05
WARMUP_STEPS = 3
# Counted in DeepSpeed's and the fork's own code: compared whatever the other libraries' versions.
OWN_COUNTERS = ("zero_python_calls_per_layer", "zero_torch_calls_per_layer", "hook_registrations", "param_hooks", "record_stream", "zero_to_calls")
OTHER_LIBRARIES = ("torch", "transformers", "peft")
OWN_CODE = (os.sep + "deepspeed" + os.sep, os.sep + "zero3_ac" + os.sep)


def _own(filename):
    return any(part in filename for part in OWN_CODE)


class MethodCounter:
    """Counts calls of ``torch.Tensor`` methods while active, and which of them DeepSpeed or the fork made."""

    METHODS = ("register_hook", "register_post_accumulate_grad_hook", "record_stream", "to")

    def __init__(self):
        import torch
        self.calls = dict.fromkeys(self.METHODS, 0)
        self.own_calls = dict.fromkeys(self.METHODS, 0)
        self._tensor = torch.Tensor
        self._saved = {}

    def _wrap(self, name, method):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            if _own(sys._getframe(1).f_code.co_filename):
                self.own_calls[name] += 1
            return method(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in self.METHODS:
            self._saved[name] = self._tensor.__dict__.get(name)
            setattr(self._tensor, name, self._wrap(name, getattr(self._tensor, name)))
        return self

    def __exit__(self, *exc):
        for name, saved in self._saved.items():
            if saved is None:
                delattr(self._tensor, name)
            else:
                setattr(self._tensor, name, saved)


def count_python_calls(function):
    """(all, own) Python function calls while ``function()`` runs in this thread."""
    counts = [0, 0]

    def profile(frame, event, arg):
        if event == "call":
            counts[0] += 1
            if _own(frame.f_code.co_filename):
                counts[1] += 1

    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return counts


def count_own_torch_calls(function):
    """Calls of torch functions and ``Tensor`` methods made by DeepSpeed's or the fork's code while ``function()`` runs."""
    import torch

    class OwnTorchCalls(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if _own(sys._getframe(1).f_code.co_filename):
                OwnTorchCalls.calls += 1
            return func(*args, **(kwargs or {}))

    with OwnTorchCalls():
        function()
    return OwnTorchCalls.calls


def param_hooks(model):
    return sum(len(getattr(param, attribute, None) or {}) for param in model.parameters()
               for attribute in ("_backward_hooks", "_post_accumulate_grad_hooks"))


def measure(rank=0, world_size=1):
    """The counters of one step, in this process (which must not have initialized torch.distributed)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size),
                      DS_ACCELERATOR="cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    warnings.filterwarnings("ignore")
    sys.path.insert(0, HERE)
    import deepspeed
    import torch
    import zero3_ac
    from deepspeed.utils import logger
    from transformers.utils import logging as hf_logging
    from workload import MODELS, build_model, zero3_config
    logger.setLevel("ERROR")
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        config = zero3_config("cpu", 1, torch.float32)
        model = build_model("tiny", "nonreentrant", False, torch.float32)
        trainable = [param for param in model.parameters() if param.requires_grad]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=config)
        generator = torch.Generator().manual_seed(0)
        vocab, layers = MODELS["tiny"]["vocab_size"], MODELS["tiny"]["num_hidden_layers"]

        def step():
            ids = torch.randint(0, vocab, (2, 32), generator=generator)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        for _ in range(WARMUP_STEPS):
            step()
        calls, own_calls = count_python_calls(step)
        with MethodCounter() as methods:
            step()
        own_torch_calls = count_own_torch_calls(step)
        counters = dict(python_calls_per_layer=calls / layers, zero_python_calls_per_layer=own_calls / layers,
                        zero_torch_calls_per_layer=own_torch_calls / layers,
                        hook_registrations=methods.calls["register_hook"]
                        + methods.calls["register_post_accumulate_grad_hook"],
                        param_hooks=param_hooks(engine.module), record_stream=methods.calls["record_stream"],
                        to_calls=methods.calls["to"], zero_to_calls=methods.own_calls["to"])
        return dict(fork_active=zero3_ac.is_active(), versions=versions(), counters=counters)
    finally:
        torch.distributed.destroy_process_group()
        from zero3_ac.utils.spawn import remove_shm_buffers
        remove_shm_buffers(int(os.environ["MASTER_PORT"]), os.environ["MASTER_ADDR"], rank)


def versions():
    return {name: importlib.metadata.version(name) for name in ("deepspeed", *OTHER_LIBRARIES)}


def measure_in_fresh_process(world_size=1):
    """:func:`measure` in new interpreters, one per rank (the fork is applied at interpreter start, and counts
    must not see an earlier model's caches); rank 0's counts."""
    from zero3_ac.utils.spawn import MASTER_ADDR, free_port
    env = {**os.environ, "MASTER_ADDR": MASTER_ADDR, "MASTER_PORT": str(free_port())}
    # The CPU comm op is built per DeepSpeed release (scripts/setup_env.sh's directory): one built by another
    # release's sources, in torch's shared default directory, fails to load here.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(HERE), ".cache", "torch_extensions",
                                                        "ds-" + importlib.metadata.version("deepspeed")))
    ranks = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--measure-here", "--rank", str(rank),
                               "--world-size", str(world_size)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world_size)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (process, (_, stderr)) in enumerate(zip(ranks, outputs)):
        if process.returncode != 0:
            raise RuntimeError(f"counting failed on rank {rank} (exit {process.returncode}):\n{stderr[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def stale_files(installed, checkout=CHECKOUT_PACKAGE):
    """The checkout's ``zero3_ac`` sources that the package in ``installed`` lacks or has otherwise: a venv set up
    before an edit. This script's processes import the installed package (the script's folder, not the checkout,
    is first on ``sys.path``), so their counts would be the older code's."""
    if not os.path.isdir(checkout) or os.path.realpath(installed) == os.path.realpath(checkout):
        return []
    stale = []
    for folder, _, names in os.walk(checkout):
        for name in names:
            if name.endswith(".py"):
                relative = os.path.relpath(os.path.join(folder, name), checkout)
                copy = os.path.join(installed, relative)
                if not os.path.exists(copy) or not filecmp.cmp(os.path.join(checkout, relative), copy, shallow=False):
                    stale.append(relative)
    return sorted(stale)


def baseline_key(deepspeed_version, world_size):
    return deepspeed_version if world_size == 1 else f"{deepspeed_version}@{world_size}"


def load_baseline():
    if not os.path.exists(BASELINE):
        return {}
    with open(BASELINE) as source:
        return json.load(source)


def compare(measured, baseline_entry):
    """(rises, lines): the counters over the baseline by more than TOLERANCE, and a line per counter."""
    same_libraries = all(baseline_entry["versions"].get(name) == measured["versions"][name]
                         for name in OTHER_LIBRARIES)
    names = list(measured["counters"]) if same_libraries else list(OWN_COUNTERS)
    rises, lines = [], []
    for name in names:
        now, then = measured["counters"][name], baseline_entry["counters"][name]
        limit = then * (1 + TOLERANCE)
        verdict = "RISE" if now > limit else ("fell: --update to lock it in" if now < then else "ok")
        if now > limit:
            rises.append(name)
        lines.append(f"{name}: {now:g} (baseline {then:g}, limit {limit:g}) {verdict}")
    if not same_libraries:
        lines.append(f"compared DeepSpeed's and the fork's own counters only: the baseline was taken with "
                     f"{ {n: baseline_entry['versions'].get(n) for n in OTHER_LIBRARIES} }, this is "
                     f"{ {n: measured['versions'][n] for n in OTHER_LIBRARIES} }")
    return rises, lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", help="write the counts as this DeepSpeed version's baseline")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes to count in; all must agree")
    parser.add_argument("--world-size", type=int, default=1, help="gloo ranks; rank 0's counts (default 1)")
    parser.add_argument("--measure-here", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_here:
        print(json.dumps(measure(args.rank, args.world_size)))
        return 0
    installed = os.path.dirname(importlib.util.find_spec("zero3_ac").origin)
    stale = stale_files(installed)
    if stale:
        print(f"the zero3_ac these counts would come from ({installed}) is not this checkout's: {', '.join(stale[:5])}"
              f"{' and more' if len(stale) > 5 else ''} differ. Install the checkout into this venv first "
              "(bash scripts/setup_env.sh DEEPSPEED_VERSION)")
        return 2
    results = [measure_in_fresh_process(args.world_size) for _ in range(args.runs)]
    measured = results[0]
    print(json.dumps(measured, indent=1))
    if any(result["counters"] != measured["counters"] for result in results[1:]):
        print("NOT deterministic: the runs counted differently:", [result["counters"] for result in results])
        return 1
    if not measured["fork_active"]:
        print("note: stock DeepSpeed (ZERO3_AC_DISABLE=1); the baseline holds the fork's counts")
    deepspeed_version = baseline_key(measured["versions"]["deepspeed"], args.world_size)
    baseline = load_baseline()
    if args.update:
        if not measured["fork_active"]:
            print("refusing to write stock DeepSpeed's counts as the fork's baseline: unset ZERO3_AC_DISABLE")
            return 1
        baseline[deepspeed_version] = dict(versions=measured["versions"], counters=measured["counters"])
        os.makedirs(os.path.dirname(BASELINE), exist_ok=True)
        with open(BASELINE, "w") as out:
            json.dump(dict(sorted(baseline.items())), out, indent=1)
            out.write("\n")
        print(f"baseline for DeepSpeed {deepspeed_version} written to {os.path.relpath(BASELINE)}")
        return 0
    if deepspeed_version not in baseline:
        print(f"no baseline for DeepSpeed {deepspeed_version}: run python benchmarks/counters.py --update"
              + (f" --world-size {args.world_size}" if args.world_size != 1 else ""))
        return 1
    rises, lines = compare(measured, baseline[deepspeed_version])
    print("\n".join(lines))
    return 1 if rises else 0


if __name__ == "__main__":
    sys.exit(main())
