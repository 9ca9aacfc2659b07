"""``profile_step.host_waits``: the host's time in calls that wait for the GPU, by the DeepSpeed or zero3_ac line
that made them, over steps run back to back; torch's methods are its own again afterwards."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
import profile_step  # noqa: E402

# A function compiled as if it were DeepSpeed's: the waits it makes are charged to its line.
_UPSTREAM_SOURCE = """
def check(norm):
    return bool(norm < 0)

def read(norm):
    return norm.item()
"""


def test_waits_are_charged_to_the_line_that_made_them_and_torch_is_restored(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # a CPU-only torch has no device
    namespace = {}
    filename = os.path.join(os.sep, "x", "site-packages", "deepspeed", "runtime", "fake.py")
    exec(compile(_UPSTREAM_SOURCE, filename, "exec"), namespace)
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "__bool__", "tolist", "cpu")}

    def step():
        norm = torch.tensor(2.0)
        namespace["check"](norm)
        namespace["read"](norm)
        norm.tolist()

    args = argparse.Namespace(profiled=3, tag="t", out=str(tmp_path), system="fork")
    waited = profile_step.host_waits(args, step, 0.1)
    site = os.path.join("deepspeed", "runtime", "fake.py")
    assert {key for key in waited if key[1].startswith(site)} == {("__bool__", f"{site}:3(check)"),
                                                                 ("item", f"{site}:6(read)")}
    assert ("tolist", "(model or loop)") in waited and ("tensor", "(model or loop)") in waited
    assert {name: getattr(torch.Tensor, name) for name in originals} == originals
    assert "__bool__" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__
    report = (tmp_path / "waits-t.txt").read_text()
    assert "back-to-back step" in report and f"__bool__ {site}:3(check)" in report
