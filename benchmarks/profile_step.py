import cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29633")
import torch, warnings
warnings.filterwarnings("ignore")
import deepspeed
from deepspeed.utils import logger
logger.setLevel("ERROR")
deepspeed.init_distributed(dist_backend="nccl")
from workload import build_model, zero3_config
import zero3_ac
torch.cuda.set_device(0)
config = zero3_config("cuda", 2, torch.bfloat16)
if os.environ.get("UNITS"):
    config["zero3_ac"] = {"gather_units": os.environ["UNITS"]}
model = build_model("tinyllama", "nonreentrant", False, torch.bfloat16, ds_config=config)
trainable = [p for p in model.parameters() if p.requires_grad]
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-4), config=config)
g = torch.Generator().manual_seed(0)
def step():
    ids = torch.randint(0, 32000, (2, 2048), generator=g).cuda()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss); engine.step(); torch.cuda.synchronize()
for _ in range(3): step()
t = time.perf_counter()
for _ in range(4): step()
print("fork", zero3_ac.is_active(), "units", os.environ.get("UNITS"), "step_s", (time.perf_counter() - t) / 4, flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(3): step()
pr.disable()
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(45); st.sort_stats("cumulative").print_stats(60)
out = os.environ["OUT"] + "/profile-" + os.environ.get("TAG", "x") + ".txt"
open(out, "w").write(s.getvalue()); pr.dump_stats(out + ".prof")
