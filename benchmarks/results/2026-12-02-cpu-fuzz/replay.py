"""Replays one fuzz example (a spec file) on stock and the fork, each in a call of its own: python replay.py SPEC stock fork."""
import sys, time
import os
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from tests.unit.common import run_distributed, shutdown_pools
from tests.unit.runtime.zero.fuzz import oracle
from tests.unit.runtime.zero.fuzz.spec import *

def run_mode(example, mode):
    import zero3_ac
    batches, seconds = oracle.micro_batches(example)
    import deepspeed.comm as dist
    rank = dist.get_rank()
    if mode == "stock":
        zero3_ac.remove()
    try:
        r = oracle.run_engine(example, batches, seconds, rank)
    finally:
        zero3_ac.apply()
    ref = oracle.run_reference(example, batches, seconds, rank)
    return oracle.problems(r, ref, rank, example.schedule.extras if mode == "fork" else None)

if __name__ == "__main__":
  EX = eval(open(sys.argv[1]).read())
  for mode in sys.argv[2:]:
      t = time.time()
      try:
          print(mode, run_distributed(EX.world_size, run_mode, EX, mode, timeout=60), f"{time.time()-t:.1f}s", flush=True)
      except Exception as e:
          print(mode, "EXC", type(e).__name__, str(e)[:1500], flush=True)
          shutdown_pools()
  shutdown_pools()
