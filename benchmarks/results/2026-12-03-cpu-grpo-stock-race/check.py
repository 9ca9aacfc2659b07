"""Launch examples/trl_grpo_lora.py on 2 CPU ranks as the parity test does; print (reward, loss) per rank and step."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from tests.integration.test_examples import launch
out = pathlib.Path(sys.argv[1]); mode = sys.argv[2]
env = {"ZERO3_AC_DISABLE": "1"} if mode == "stock" else {}
args = ("--trl-default",) if mode == "stock" else ()
kw = {"ds_config": sys.argv[3]} if len(sys.argv) > 3 else {}
result, s = launch("accelerate", "trl_grpo_lora.py", out, *args, **kw, **env)
print(mode, result.returncode, [[(round(l["reward"], 6), round(l["loss"], 6)) for l in s[r]["logs"]] for r in sorted(s)])
