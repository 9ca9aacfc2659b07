import cProfile, pstats, sys, os, io
sys.path.insert(0, "benchmarks")
import counters
orig = counters.count_python_calls
def prof(function):
    p = cProfile.Profile()
    p.enable(); function(); p.disable()
    s = pstats.Stats(p)
    rows = []
    for (f, l, n), (cc, nc, tt, ct, callers) in s.stats.items():
        rows.append((nc, tt, f"{f.split('site-packages/')[-1]}:{l}({n})"))
    rows.sort(reverse=True)
    own = [r for r in rows if "deepspeed" in r[2] or "zero3_ac" in r[2]]
    with open(os.environ.get("BREAKDOWN_OUT", "/tmp/prof/out.txt"), "w") as out:
        out.write("own total calls %d\n" % sum(r[0] for r in own))
        for r in own[:80]:
            out.write("%7d %8.4f %s\n" % r)
        out.write("\nall\n")
        for r in rows[:60]:
            out.write("%7d %8.4f %s\n" % r)
    return orig(function)
counters.count_python_calls = prof
import json
print(json.dumps(counters.measure()))
