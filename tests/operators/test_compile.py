"""torch.compile with fullgraph (issue 40, goal 2): every public function compiles into one
graph per call, and the compiled function equals eager on inputs it never saw, bitwise where the
same kernels run (the graph's densematch operators are eager's own code)."""

import numpy as np
import pytest
import torch

import densematch
from densematch._oprules import read_once

from .._reference import assert_same_up_to_ties

pytestmark = pytest.mark.slow


def _astronaut_features(top: int, left: int, size: int = 24) -> torch.Tensor:
    """(1, 27, size, size) 3x3 colour patches of a crop of skimage's astronaut."""
    from skimage import data

    img = torch.tensor(data.astronaut()[top : top + size, left : left + size].astype(np.float32) / 255)
    patches = torch.nn.functional.unfold(img.permute(2, 0, 1)[None], 3, padding=1)
    return patches.reshape(1, 27, size, size)


class Graphs:
    """A backend that counts the graphs Dynamo hands it and runs each as captured."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, gm, example_inputs):
        self.count += 1
        return gm.forward


def _compiled(fn):
    torch._dynamo.reset()
    graphs = Graphs()
    return torch.compile(fn, backend=graphs, fullgraph=True), graphs


def _same(got, want) -> bool:
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    return all(
        torch.equal(torch.nan_to_num(g, nan=-7.0), torch.nan_to_num(w, nan=-7.0))
        for g, w in zip(got, want, strict=True)
    )


A, B = _astronaut_features(100, 100), _astronaut_features(103, 98)
A2, B2 = _astronaut_features(200, 150), _astronaut_features(202, 151)
P = torch.randn(6, 27)
CASES = {
    "pairwise_distance": lambda a, b: densematch.pairwise_distance(a, P, metric="cosine"),
    "PrototypeDistance": lambda a, b: densematch.PrototypeDistance(6, 27, metric="l1")(a),
    "nearest_prototype": lambda a, b: densematch.nearest_prototype(a, P, metric="l2", k=2),
    "match": lambda a, b: (
        densematch.match(a[0], b[0], layout="chw", mutual=True).index,
        densematch.match(a[0], b[0], layout="chw", mutual=True).score,
    ),
    "soft_match": lambda a, b: densematch.soft_match(a[0], b[0], layout="chw", temperature=0.05).coords,
    "local_match": lambda a, b: densematch.local_match(a, b, radius=3).index,
    "local_cost_volume": lambda a, b: densematch.local_cost_volume(a, b, radius=2, metric="cosine"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_one_graph_and_eager_results_on_new_inputs(name):
    torch.manual_seed(0)
    fn = CASES[name]
    if name == "PrototypeDistance":
        layer = densematch.PrototypeDistance(6, 27, metric="l1")
        fn = lambda a, b: layer(a)  # noqa: E731
    compiled, graphs = _compiled(fn)
    compiled(A, B)
    assert graphs.count == 1
    got, want = compiled(A2, B2), fn(A2, B2)  # same sizes, values it never saw: no new graph
    assert graphs.count == 1
    if name == "local_cost_volume":  # eager runs C kernels here, the graph torch's operators
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert _same(got, want)


def test_forward_and_backward_compile_into_one_graph_with_eager_gradients():
    layer = densematch.PrototypeDistance(6, 27, metric="l2")
    compiled, graphs = _compiled(lambda x: layer(x).square().mean())
    x = A2.clone().requires_grad_()
    compiled(A.clone().requires_grad_()).backward()
    layer.zero_grad()
    compiled(x).backward()
    got = (x.grad.clone(), layer.prototypes.grad.clone())
    x.grad, layer.prototypes.grad = None, None
    layer(x).square().mean().backward()
    assert graphs.count == 1
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.prototypes.grad)


def test_inductor_matches_eager_and_local_volumes_stay_finite():
    # torch.compile(local_cost_volume) once gave whole planes of NaN (issue 40)
    torch._dynamo.reset()
    lcv = torch.compile(lambda a, b: densematch.local_cost_volume(a, b, radius=2, metric="l2"), fullgraph=True)
    got = lcv(A2, B2)
    assert not torch.isnan(got).any()  # offsets off the map are inf, as in eager
    torch.testing.assert_close(got, densematch.local_cost_volume(A2, B2, radius=2, metric="l2"), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    nearest = torch.compile(lambda a: densematch.nearest_prototype(a, P, metric="cosine", k=3), fullgraph=True)
    value, index = nearest(A2)
    rows = A2[0].flatten(1).T
    want = densematch.nearest_prototype(A2, P, metric="cosine", k=3)[1]
    assert_same_up_to_ties(rows, P, index[0].flatten(1).T, want[0].flatten(1).T, "cosine")
    assert torch.isfinite(value).all()


def test_settings_are_read_when_the_graph_is_made():
    # a compiled graph keeps the budget it was made with (docs/compile.md)
    with densematch.config_context(memory="1MiB"):
        compiled, _ = _compiled(lambda x: densematch.pairwise_distance(x, P))
        out = compiled(A)
    assert torch.equal(out, densematch.pairwise_distance(A, P))


def test_finite_check_is_kept_in_the_graph():
    compiled, _ = _compiled(lambda x: densematch.match(x[0], B[0], layout="chw").index)
    compiled(A)
    bad = A.clone()
    bad[0, 0, 3, 3] = float("nan")
    with pytest.raises(RuntimeError, match="finite"):
        compiled(bad)


def test_read_once_sets_the_mark_torch_sets():
    def mine():
        return 1

    def theirs():
        return 1

    before = set(vars(theirs))
    torch.compiler.assume_constant_result(theirs)
    assert set(vars(read_once(mine))) == set(vars(theirs)) != before
