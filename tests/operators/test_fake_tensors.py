"""Fake tensors never reach the C kernels (issue 40, goal 4): under FakeTensorMode the C kernels
and the worker threads stand aside, so what runs is torch's own operators on this thread."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import densematch
from densematch.kernels import native
from densematch.threads import traced, workers_for

SCRIPT = textwrap.dedent(
    """
    import json, torch, densematch, densematch.kornia
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.set_num_threads(2)
    got = {}
    with FakeTensorMode():
        x, p = torch.randn(2, 8, 5, 6), torch.randn(4, 8)
        for metric in ("l1", "linf", "cosine", "dot"):
            got[metric] = list(densematch.pairwise_distance(x, p, metric, check_finite=False).shape)
        got["module"] = list(densematch.PrototypeDistance(4, 8, "l1")(x).shape)
        got["l2"] = list(densematch.pairwise_distance(x, p, "l2").shape)
        got["nearest"] = list(densematch.nearest_prototype(x, p, k=2)[1].shape)
        got["knn"] = list(densematch.knn(torch.randn(7, 8), p, k=3)[1].shape)
        a, b = torch.randn(5, 6, 8), torch.randn(5, 6, 8)
        got["match"] = list(densematch.match(a, b, mutual=True, k=2).index.shape)
        got["soft_match"] = list(densematch.soft_match(a, b).coords.shape)
        got["local_cost_volume"] = list(densematch.local_cost_volume(x, x, radius=1).shape)
        got["local_match"] = list(densematch.local_match(a, b, radius=2, k=3).coords.shape)
        try:  # Lowe's test keeps a number of matches known only from the data: torch says so
            densematch.kornia.match_snn(torch.randn(7, 8), p)
            got["match_snn"] = "ran"
        except Exception as err:
            got["match_snn"] = type(err).__name__
    print(json.dumps(got))
    """
)


@pytest.mark.skipif(not native.usable(torch.device("cpu"), torch.float32), reason="the C kernels are not built here")
def test_fake_tensors_get_shapes_and_never_crash_the_process():
    # pairwise_distance(check_finite=False) and PrototypeDistance handed fake storage to C:
    # SIGSEGV. Each call now gives the fake output's shape (the operators' fake kernels), or
    # raises torch's own error where a shape depends on the data
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for metric in ("l1", "linf", "cosine", "dot", "module", "l2"):
        assert got[metric] == [2, 4, 5, 6], got
    assert got["nearest"] == [2, 2, 5, 6] and got["knn"] == [7, 3] and got["match"] == [5, 6, 2]
    assert got["soft_match"] == [5, 6, 2] and got["local_cost_volume"] == [2, 3, 3, 8, 5]
    assert got["local_match"] == [5, 6, 3, 2]
    assert got["match_snn"] == "DynamicOutputShapeException"


def test_a_dispatch_mode_keeps_the_work_on_this_thread_and_off_c():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    assert not traced()
    with FakeTensorMode():
        assert traced() and workers_for(cpu) == 1 and not native.usable(cpu, torch.float32)
    # and outside it, the same call on real tensors is what it was
    x, p = torch.randn(1, 3, 4, 4), torch.randn(5, 3)
    assert densematch.pairwise_distance(x, p, metric="l1").shape == (1, 5, 4, 4)
