"""Export (issue 40, goal 3): torch.export, ONNX through densematch.onnx.decompose and
onnxruntime, torch.jit.trace and save; each run on inputs of sizes the export never saw and
compared with eager. The TorchScript ONNX exporter, which once wrote one constant for a whole
model, now refuses with an error that says what to do."""

import io
import math

import numpy as np
import onnxruntime
import pytest
import torch

import densematch
import densematch.onnx
from densematch import kornia as dk

from .._reference import assert_same_up_to_ties

pytestmark = [
    pytest.mark.slow,
    # the trace's own notes on Python branches and sizes (the tests run the traces at other sizes)
    pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:torch"),
    # onnxscript asks torch.utils._pytree a deprecated question
    pytest.mark.filterwarnings("ignore:.*treespec, LeafSpec:FutureWarning"),
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
]

METRICS = ["l2", "cosine", "l1", "linf", "dot", "sqeuclidean"]
MAPS = {"x": {0: torch.export.Dim("n"), 2: torch.export.Dim("h"), 3: torch.export.Dim("w")}}
ROWS = {"a": {0: torch.export.Dim("na")}, "b": {0: torch.export.Dim("nb")}}


class Matcher(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = getattr(dk, name)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(a, b)


def _onnx_run(program, *inputs: torch.Tensor) -> list[np.ndarray]:
    onnx_program = torch.onnx.export(densematch.onnx.decompose(program), dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(onnx_program.model_proto.SerializeToString())
    return session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})


def _photo_maps(n: int, h: int, w: int) -> torch.Tensor:
    from skimage import data

    img = torch.tensor(data.coffee()[:h, :w].astype(np.float32) / 255).permute(2, 0, 1)
    maps = torch.nn.functional.unfold(img[None], 3, padding=1).reshape(1, 27, h, w)[:, :8]
    return torch.cat([maps + 0.01 * i for i in range(n)])


@pytest.mark.parametrize("metric", METRICS)
def test_exported_prototype_distance_equals_eager_at_other_sizes(metric):
    layer = densematch.PrototypeDistance(5, 8, metric=metric)
    program = torch.export.export(layer, (torch.randn(2, 8, 5, 6),), dynamic_shapes=MAPS)
    x = _photo_maps(3, 11, 13)
    want = layer(x)
    assert torch.equal(program.module()(x), want)
    (got,) = _onnx_run(program, x)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["match_nn", "match_mnn"])
def test_exported_kornia_matchers_equal_eager_at_other_sizes(name):
    program = torch.export.export(Matcher(name), (torch.randn(10, 16), torch.randn(12, 16)), dynamic_shapes=ROWS)
    for na, nb in ((30, 25), (7, 40)):
        a, b = torch.randn(na, 16), torch.randn(nb, 16)
        want = getattr(dk, name)(a, b)
        got = program.module()(a, b)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    dists, idxs = _onnx_run(program, a, b)
    # onnxruntime sums in its own order: its picks may break a float32 near-tie the other way
    queries = want[1][:, 0]
    assert np.array_equal(idxs[:, 0], queries.numpy())
    assert_same_up_to_ties(a[queries], b, torch.from_numpy(idxs[:, 1]), want[1][:, 1], "l2")
    np.testing.assert_allclose(dists, want[0].numpy(), rtol=1e-5)


class Soft(torch.nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def forward(self, a: torch.Tensor, b: torch.Tensor, mask_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = densematch.soft_match(a, b, mask_b=mask_b, **self.options)
        return s.coords, s.max_weight


@pytest.mark.parametrize("options", [{}, {"temperature": 0.1, "mode": "dual_softmax"}], ids=["auto", "dual"])
def test_exported_soft_match_equals_eager_at_other_sizes(options):
    grids = {0: torch.export.Dim("h", min=2), 1: torch.export.Dim("w", min=2)}
    grids_b = {0: torch.export.Dim("hb", min=2), 1: torch.export.Dim("wb", min=2)}
    dims = {"a": grids, "b": {**grids_b}, "mask_b": grids_b}
    model = Soft(**options)
    # float64: the automatic temperature's sharp rows move float32 coordinates by ~4e-3 px between
    # any two orders of summation (the tiles' and onnxruntime's)
    example = (torch.randn(6, 7, 8).double(), torch.randn(5, 6, 8).double(), torch.ones(5, 6, dtype=torch.bool))
    program = torch.export.export(model, example, dynamic_shapes=dims)
    photo = _photo_maps(1, 24, 30)[0].permute(1, 2, 0).double()
    a, b = photo[2:14, 3:20].contiguous(), photo[:16, :22].contiguous()
    mask = torch.rand(16, 22, generator=torch.Generator().manual_seed(0)) > 0.2
    want = model(a, b, mask)
    got = program.module()(a, b, mask)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    coords, top = _onnx_run(program, a, b, mask)
    np.testing.assert_allclose(coords, want[0].numpy(), atol=1e-8)
    np.testing.assert_allclose(top, want[1].numpy(), rtol=1e-8, atol=1e-12)


class Volume(torch.nn.Module):
    def __init__(self, metric: str) -> None:
        super().__init__()
        self.metric = metric

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return densematch.local_cost_volume(a, b, (1, 2), metric=self.metric, layout="chw")


@pytest.mark.parametrize("metric", ["cosine", "l2"])
def test_exported_local_cost_volume_equals_eager_at_other_sizes(metric):
    # the windows are one operator: the program is not specialised to the example's grid
    model = Volume(metric)
    maps = {0: torch.export.Dim("n"), 2: torch.export.Dim("h", min=2), 3: torch.export.Dim("w", min=2)}
    example = (torch.randn(2, 8, 6, 7), torch.randn(2, 8, 6, 7))
    program = torch.export.export(model, example, dynamic_shapes=(maps, maps))
    x = _photo_maps(3, 17, 23)
    a, b = x, torch.roll(x, shifts=(1, -2), dims=(2, 3))
    assert torch.equal(program.module()(a, b), model(a, b))


class MovedVolume(torch.nn.Module):
    def __init__(self, metric: str, sampling: str) -> None:
        super().__init__()
        self.metric, self.sampling = metric, sampling

    def forward(self, a, b, flow, mask_a, mask_b) -> torch.Tensor:
        return densematch.local_cost_volume(
            a, b, (1, 2), dilation=(2, 1), flow=flow, sampling=self.sampling, metric=self.metric,
            mask_a=mask_a, mask_b=mask_b, fill=math.nan,
        )  # fmt: skip


def test_onnx_local_cost_volume_equals_eager_at_other_sizes():
    # decomposed into gathers of every offset: onnxruntime gives eager's values, and the missing
    # candidates (outside b, masked out, a masked pixel of a) in the same places (the local_match
    # test below runs the decomposition's other branch: cosine of unit rows, a rounded flow)
    model = MovedVolume("l2", "bilinear")
    grid = {0: torch.export.Dim("h", min=2), 1: torch.export.Dim("w", min=2)}
    example = (
        torch.randn(6, 7, 8).double(), torch.randn(6, 7, 8).double(), torch.randn(6, 7, 2).double(),
        torch.ones(6, 7, dtype=torch.bool), torch.ones(6, 7, dtype=torch.bool),
    )  # fmt: skip
    program = torch.export.export(model, example, dynamic_shapes=(grid,) * 5)
    g = torch.Generator().manual_seed(0)
    photo = _photo_maps(1, 24, 30)[0].permute(1, 2, 0).double()
    a, b = photo[:13, :17].contiguous(), photo[1:14, 2:19].contiguous()
    flow = 1.5 * torch.randn(13, 17, 2, generator=g, dtype=torch.float64)
    masks = (torch.rand(13, 17, generator=g) > 0.2, torch.rand(13, 17, generator=g) > 0.2)
    want = model(a, b, flow, *masks).numpy()
    (got,) = _onnx_run(program, a, b, flow, *masks)
    missing = np.isnan(want)
    assert np.array_equal(np.isnan(got), missing) and missing.any() and not missing.all()
    np.testing.assert_allclose(got[~missing], want[~missing], rtol=1e-12, atol=1e-12)


class LocalBest(torch.nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def forward(self, a, b, flow) -> tuple[torch.Tensor, ...]:
        m = densematch.local_match(a, b, (2, 1), flow=flow, layout="chw", **self.options)
        return m.index, m.score, m.valid, m.coords


def _same_matches(got, want) -> bool:
    return all(torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0)) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("options", [{"metric": "cosine"}, {"metric": "l2", "k": 3, "sampling": "bilinear"}])
def test_exported_and_traced_local_match_equal_eager_at_other_sizes(options):
    # densematch::local_topk: one node, so neither the program nor the trace is fixed to the
    # example's grid (a trace of the band loop once was); its scores' gradient goes through the
    # cost volume's backward operator and equals eager's recomputed pairs
    model = LocalBest(**options)
    n, h, w = torch.export.Dim("n"), torch.export.Dim("h", min=2), torch.export.Dim("w", min=2)
    dims = ({0: n, 2: h, 3: w}, {0: n, 2: h, 3: w}, {0: n, 1: h, 2: w})
    example = (torch.randn(2, 8, 6, 7), torch.randn(2, 8, 6, 7), torch.randn(2, 6, 7, 2))
    program = torch.export.export(model, example, dynamic_shapes=dims)
    traced = torch.jit.trace(model, (example[0].requires_grad_(), *example[1:]))
    x = _photo_maps(3, 17, 23)
    a, b = x, torch.roll(x, shifts=(1, -2), dims=(2, 3))
    flow = 1.5 * torch.randn(3, 17, 23, 2, generator=torch.Generator().manual_seed(0))
    want = model(a, b, flow)
    assert _same_matches(program.module()(a, b, flow), want)
    leaves = a.clone().requires_grad_(), a.clone().requires_grad_()
    got = traced(leaves[0], b, flow)
    assert _same_matches(got, want)
    grads = [
        torch.autograd.grad(out[1].nan_to_num(0.0).sum(), x)[0]
        for out, x in ((got, leaves[0]), (model(leaves[1], b, flow), leaves[1]))
    ]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    # the decomposition ONNX exports (its gathers run in onnxruntime in the cost volume's test
    # above, its TopK in the matchers'): the same best values in the same order, their offsets
    # free to differ at near-ties
    _index, score, valid, _coords = (t.numpy() for t in densematch.onnx.decompose(program).module()(a, b, flow))
    np.testing.assert_array_equal(valid, want[2].numpy())
    np.testing.assert_allclose(score[valid], want[1].numpy()[valid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["match_nn", "match_mnn", "match_snn", "match_smnn"])
def test_traced_kornia_matchers_equal_eager_at_other_sizes(name):
    fn = getattr(dk, name)
    traced = torch.jit.trace(Matcher(name), (torch.randn(10, 16), torch.randn(12, 16)), check_trace=False)
    saved = io.BytesIO()
    torch.jit.save(traced, saved)
    saved.seek(0)
    loaded = torch.jit.load(saved)
    for na, nb in ((11, 13), (20, 7), (5, 5)):
        a, b = torch.randn(na, 16), torch.randn(nb, 16)
        want = fn(a, b)
        for run in (traced, loaded):
            got = run(a, b)
            assert got[0].shape == want[0].shape and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_traced_descriptor_matcher_and_prototype_distance_equal_eager_at_other_sizes():
    matcher = dk.DescriptorMatcher("snn", 0.9)
    traced = torch.jit.trace(matcher, (torch.randn(10, 16), torch.randn(12, 16)), check_trace=False)
    a, b = torch.randn(30, 16), torch.randn(25, 16)
    assert torch.equal(traced(a, b)[1], matcher(a, b)[1])
    layer = densematch.PrototypeDistance(4, 8, metric="l1")
    traced = torch.jit.trace(layer, torch.randn(2, 8, 3, 3))
    saved = io.BytesIO()
    torch.jit.save(traced, saved)
    saved.seek(0)
    x = _photo_maps(3, 7, 9)
    assert torch.equal(torch.jit.load(saved)(x), layer(x))


def test_the_torchscript_onnx_exporter_refuses_clearly():
    for model, args in (
        (densematch.PrototypeDistance(4, 8), (torch.randn(1, 8, 4, 4),)),
        (Matcher("match_snn"), (torch.randn(6, 8), torch.randn(7, 8))),
    ):
        with pytest.raises(RuntimeError, match=r"densematch\.onnx\.decompose"):
            torch.onnx.export(model, args, io.BytesIO(), dynamo=False)


def test_decompose_takes_an_exported_program():
    with pytest.raises(TypeError, match="ExportedProgram"):
        densematch.onnx.decompose(densematch.PrototypeDistance(2, 3))
