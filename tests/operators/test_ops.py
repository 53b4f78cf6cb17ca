"""densematch's operations as PyTorch operators (issue 40, goal 1): each passes torch's own
operator checks (schema, fake kernel, autograd registration, AOT dispatch), and the public
functions call them, so that a recorded graph holds one node per operation."""

import subprocess
import sys

import pytest
import torch

import densematch
from densematch import engine
from densematch.metrics import METRICS, get_metric
from densematch.precision import Precision

BUDGET = 1 << 26


def _maps(channels_last: bool) -> torch.Tensor:
    x = torch.randn(2, 8, 5, 7)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("metric", sorted(METRICS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_pairwise_distance_op_passes_opcheck(metric, channels_last):
    x = _maps(channels_last).requires_grad_()
    p = torch.randn(4, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.densematch.pairwise_distance.default, (x, p, metric, BUDGET, True, False, True))


@pytest.mark.parametrize("metric", ["l2", "cosine", "l1"])
def test_pairwise_distance_backward_op_passes_opcheck(metric):
    x, p = torch.randn(2, 8, 5, 7), torch.randn(4, 8)
    out = densematch.pairwise_distance(x, p, metric=metric)
    grad = torch.randn_like(out)
    for need_x in (True, False):
        torch.library.opcheck(
            torch.ops.densematch.pairwise_distance_backward.default, (grad, x, p, out, metric, BUDGET, True, need_x)
        )


@pytest.mark.parametrize(
    ("metric", "half", "rows"),
    [("l2", "", False), ("cosine", "bfloat16", True), ("l1", "", True), ("dot", "float16", False)],
)
def test_topk_op_passes_opcheck(metric, half, rows):
    a, b = torch.randn(30, 8), torch.randn(40, 8)
    rows_a, rows_b = (torch.arange(0, 30, 3), torch.arange(5, 40)) if rows else (None, None)
    args = (a, b, metric, 3, BUDGET, "exact", torch.float32, half, True, "auto", None, rows_a, rows_b, 0)
    torch.library.opcheck(torch.ops.densematch.topk.default, args)


@pytest.mark.parametrize(
    ("dual", "auto", "masked"), [(False, False, False), (True, True, False), (False, True, True), (True, False, True)]
)
def test_soft_moments_ops_pass_opcheck(dual, auto, masked):
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(2, 20, 8, generator=g, requires_grad=True),
        torch.randn(2, 30, 8, generator=g, requires_grad=True),
    )
    mask = torch.rand(2, 30, generator=g) > 0.3 if masked else None
    values = torch.randn(30, 3, dtype=torch.float64, generator=g)
    args = (a, b, mask, values, 4.0, dual, auto, BUDGET)
    torch.library.opcheck(torch.ops.densematch.soft_moments.default, args)
    with torch.no_grad():
        moments, _top, lse, col_lse, row_scale = torch.ops.densematch.soft_moments(*args)
    grad = torch.randn_like(moments)
    back = (grad, a.detach(), b.detach(), mask, values, moments, lse, col_lse, row_scale, 4.0, dual, BUDGET)
    torch.library.opcheck(torch.ops.densematch.soft_moments_backward.default, back)


@pytest.mark.parametrize(
    ("metric", "flow", "masked"),
    [
        ("cosine", None, False),
        ("l2", "nearest", True),
        ("dot", "bilinear", False),
        ("l1", None, True),
        ("cosine", "bilinear", True),
        ("linf", "bilinear", False),
        ("sqeuclidean", None, False),
    ],
)
def test_local_cost_volume_ops_pass_opcheck(metric, flow, masked):
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(2, 6, 7, 4, generator=g, requires_grad=True),
        torch.randn(2, 6, 7, 4, generator=g, requires_grad=True),
    )
    moved = None
    if flow == "nearest":
        moved = torch.randint(-2, 3, (2, 6, 7, 2), generator=g)
    elif flow == "bilinear":
        moved = (2 * torch.rand(2, 6, 7, 2, generator=g) - 1).requires_grad_()
    mask = (torch.rand(2, 6, 7, generator=g) > 0.3) if masked else None
    fill = 0.0 if metric in ("cosine", "dot") else float("inf")
    settings = ([1, 2], [1, 1], flow or "nearest", metric)
    args = (a, b, moved, mask, mask, *settings, fill, BUDGET, True)
    torch.library.opcheck(torch.ops.densematch.local_cost_volume.default, args)
    if moved is not None:  # the top-k's own checks, with a flow (nearest and bilinear)
        picks = (a, b, moved, mask, mask, *settings, 3, BUDGET, True)
        torch.library.opcheck(torch.ops.densematch.local_topk.default, picks)
    grad = torch.randn(2, 3, 5, 6, 7, generator=g)
    back = (
        grad,
        a.detach(),
        b.detach(),
        None if moved is None else moved.detach(),
        mask,
        mask,
        *settings,
        BUDGET,
        True,
    )
    torch.library.opcheck(torch.ops.densematch.local_cost_volume_backward.default, back)


def test_the_op_equals_the_engine_it_wraps():
    a, b = torch.randn(50, 16), torch.randn(70, 16)
    m = get_metric("cosine")
    prec = Precision("exact", half=torch.bfloat16)
    want = engine.topk(a, b, metric=m, k=4, budget=BUDGET, precision=prec, rows_b=torch.arange(10, 60))
    args = ("cosine", 4, BUDGET, "exact", torch.float32, "bfloat16", True, "auto", None, None, torch.arange(10, 60), 0)
    got = torch.ops.densematch.topk(a, b, *args)  # through the dispatcher, as a recorded graph runs it
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_plain_eager_calls_skip_the_dispatcher_and_torch_dynamo():
    # an operator's first call through the dispatcher imports torch._dynamo (2-3 s on 2 cores):
    # every public function's first eager call paid it before, and a plain call needs none of it
    code = (
        "import sys, torch, densematch\n"
        "a, b, p = torch.randn(1, 8, 6, 7), torch.randn(1, 8, 6, 7), torch.randn(5, 8, requires_grad=True)\n"
        "densematch.match(a, b, mutual=True); densematch.nearest_prototype(a, p)\n"
        "densematch.pairwise_distance(a, p).sum().backward()\n"
        "densematch.soft_match(a, b.requires_grad_(), mode='dual_softmax').coords.sum().backward()\n"
        "densematch.local_cost_volume(a, b, 2).sum().backward()\n"
        "densematch.align(torch.rand(10, 10), torch.rand(16, 16))\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _ops_called(fn) -> set[str]:
    """The densematch operators ``fn`` dispatches."""
    seen: set[str] = set()

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "densematch":
                seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return seen


def test_public_functions_run_through_the_operators():
    x, p = torch.randn(1, 8, 6, 7), torch.randn(5, 8)
    a, b = torch.randn(6, 7, 8), torch.randn(6, 7, 8)
    assert _ops_called(lambda: densematch.pairwise_distance(x, p)) == {"pairwise_distance"}
    assert _ops_called(lambda: densematch.nearest_prototype(x, p, k=2)) == {"topk"}
    assert _ops_called(lambda: densematch.match(a, b, mutual=True)) == {"topk"}
    assert _ops_called(lambda: densematch.soft_match(a, b, mode="dual_softmax")) == {"soft_moments"}
    assert _ops_called(lambda: densematch.local_cost_volume(a, b, 2)) == {"local_cost_volume"}
    assert _ops_called(lambda: densematch.knn(torch.randn(9, 8), p)) == {"topk"}
    assert _ops_called(lambda: densematch.kornia.match_snn(torch.randn(9, 8), p)) == {"topk"}
