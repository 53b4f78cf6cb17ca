import pytest
import torch

import densematch
from densematch import PrototypeDistance, nearest_prototype, pairwise_distance

from .._reference import METRICS, assert_same_up_to_ties
from .._threads import torch_threads


def broadcast_reference(x: torch.Tensor, p: torch.Tensor, metric: str) -> torch.Tensor:
    """The recipe the library replaces, in float64: (N, H, W, F, D) broadcast, reduced over D."""
    xr = x.double().permute(0, 2, 3, 1)[..., None, :]
    p = p.double().reshape(p.shape[0], -1)
    diff = xr - p
    out = {
        "l2": lambda: diff.norm(dim=-1),
        "sqeuclidean": lambda: diff.square().sum(-1),
        "l1": lambda: diff.abs().sum(-1),
        "linf": lambda: diff.abs().amax(-1),
        "cosine": lambda: (
            1
            - (
                xr
                / xr.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                * (p / p.norm(dim=-1, keepdim=True).clamp_min(1e-12))
            ).sum(-1)
        ),
        "dot": lambda: (xr * p).sum(-1),
    }[metric]()
    return out.permute(0, 3, 1, 2)


class TestPairwiseDistance:
    @pytest.mark.parametrize("metric", METRICS)
    @pytest.mark.parametrize("channels_last", [False, True])
    def test_matches_float64_broadcast(self, metric, channels_last):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 24, 9, 11, generator=g) * 2 + 0.5
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        p = torch.randn(17, 24, 1, 1, generator=g)
        d = pairwise_distance(x, p, metric=metric, memory="200KiB")
        ref = broadcast_reference(x, p, metric)
        assert d.shape == (3, 17, 9, 11) and d.dtype == torch.float32
        assert d.is_contiguous(memory_format=torch.channels_last) == channels_last
        scale = ref.abs().max().item()
        torch.testing.assert_close(d.double(), ref, rtol=0, atol=1e-4 * scale)

    def test_real_image_patches(self, camera_small):
        from .._reference import patch_features

        x = patch_features(camera_small).permute(2, 0, 1)[None]  # (1, 25, 64, 64)
        protos = x.flatten(2)[0, :, ::97].T  # real patches as prototypes
        for metric in METRICS:
            d = pairwise_distance(x, protos, metric=metric)
            ref = broadcast_reference(x, protos, metric)
            torch.testing.assert_close(d.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())

    def test_identical_vectors_give_zero_never_negative_or_nan(self):
        p = torch.randn(5, 32) * 1000 + 5000  # large norms: the expansion cancels badly
        x = p.T.reshape(1, 32, 1, 5).clone()
        for metric in ["l2", "sqeuclidean"]:
            d = pairwise_distance(x, p, metric=metric)
            diag = d[0, torch.arange(5), 0, torch.arange(5)]
            assert (d >= 0).all() and not d.isnan().any()
            assert diag.abs().max() < 1e-3 * (p.norm(dim=1).max() if metric == "l2" else 1)

    def test_l2_gradient_at_zero_distance_is_zero(self):
        p = torch.randn(4, 6, requires_grad=True)
        x = p.detach().T.reshape(1, 6, 2, 2).clone().requires_grad_()
        pairwise_distance(x, p, metric="l2").sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(p.grad).all()
        d, _ = nearest_prototype(x, p, metric="l2")
        gx, gp = torch.autograd.grad(d.sum(), (x, p))
        assert (gx == 0).all() and (gp == 0).all()

    def test_cosine_zero_vectors(self):
        x = torch.zeros(1, 4, 2, 2)
        p = torch.randn(3, 4)
        p[1] = 0
        d = pairwise_distance(x, p, metric="cosine")
        assert not d.isnan().any() and (d == 1).all()

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
    def test_half_inputs_compute_in_float32_and_do_not_overflow(self, dtype):
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(2, 64, 4, 4, generator=g) * 300).to(dtype)  # ||x||^2 ~ 6e6 > fp16 max
        p = (torch.randn(8, 64, generator=g) * 300).to(dtype)
        d = pairwise_distance(x, p, metric="l2")
        assert d.dtype == dtype and torch.isfinite(d).all()
        ref = broadcast_reference(x, p, "l2")
        torch.testing.assert_close(d.double(), ref, rtol=1e-2, atol=0)

    def test_autocast_stays_float32(self):
        x, p = torch.randn(2, 16, 5, 5), torch.randn(7, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = pairwise_distance(x, p, metric="l2")
        assert d.dtype == torch.float32
        torch.testing.assert_close(d.double(), broadcast_reference(x, p, "l2"), rtol=0, atol=1e-4)

    @pytest.mark.parametrize("metric", METRICS)
    def test_gradcheck(self, metric):
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, 5, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
        p = torch.randn(6, 5, dtype=torch.float64, generator=g, requires_grad=True)
        # a tiny budget forces many tiles in both passes
        assert torch.autograd.gradcheck(lambda x, p: pairwise_distance(x, p, metric=metric, memory=6000), (x, p))

    @pytest.mark.parametrize("metric", METRICS)
    def test_gradients_match_the_broadcast_recipe(self, metric):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(2, 12, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
        p = torch.randn(9, 12, dtype=torch.float64, generator=g, requires_grad=True)
        w = torch.randn(2, 9, 6, 5, dtype=torch.float64, generator=g)
        ours = torch.autograd.grad((pairwise_distance(x, p, metric=metric) * w).sum(), (x, p))
        ref = torch.autograd.grad((broadcast_reference(x, p, metric) * w).sum(), (x, p))
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b)

    def test_module_trains_like_the_broadcast_recipe(self):
        torch.manual_seed(0)
        layer = PrototypeDistance(4, 3, metric="l1")
        twin = torch.nn.Parameter(layer.prototypes.detach().clone())
        x = torch.randn(2, 3, 8, 8)
        opts = torch.optim.Adam(layer.parameters(), lr=0.1), torch.optim.Adam([twin], lr=0.1)
        losses = []
        for _ in range(30):
            pair = layer(x).amin(1).mean(), broadcast_reference(x, twin, "l1").amin(1).mean()
            for opt, loss in zip(opts, pair, strict=True):
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append([v.item() for v in pair])
        losses = torch.tensor(losses)
        torch.testing.assert_close(losses[:, 0], losses[:, 1], rtol=1e-4, atol=1e-5)
        assert losses[-1, 0] < 0.95 * losses[0, 0]
        assert "metric='l1'" in repr(layer)


class TestNearestPrototype:
    @pytest.mark.parametrize("metric", METRICS)
    @pytest.mark.parametrize("k", [1, 3])
    def test_true_nearest(self, metric, k):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(2, 10, 7, 6, generator=g)
        p = torch.randn(40, 10, generator=g)
        d, i = nearest_prototype(x, p, metric=metric, k=k, memory="100KiB")
        ref = broadcast_reference(x, p, metric)
        best = ref.topk(k, dim=1, largest=metric == "dot").values
        got = ref.gather(1, i if k > 1 else i[:, None])
        assert d.shape == i.shape == ((2, k, 7, 6) if k > 1 else (2, 7, 6))
        torch.testing.assert_close(got, best, rtol=0, atol=1e-5)
        torch.testing.assert_close(d.double(), got if k > 1 else got[:, 0], rtol=0, atol=1e-5)

    def test_distance_recomputed_exactly_far_from_origin(self):
        g = torch.Generator().manual_seed(5)
        p = torch.randn(50, 16, generator=g) + 3000.0
        x = (p[[3, 17, 42]] + 1e-2 * torch.randn(3, 16, generator=g)).T.reshape(1, 16, 1, 3)
        d, i = nearest_prototype(x, p, metric="l2")
        assert i.reshape(-1).tolist() == [3, 17, 42]
        ref = broadcast_reference(x, p, "l2").amin(1)
        torch.testing.assert_close(d.double(), ref, rtol=1e-3, atol=0)

    def test_differentiable(self):
        x = torch.randn(1, 4, 3, 3, dtype=torch.float64, requires_grad=True)
        p = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda x, p: nearest_prototype(x, p, metric="l1")[0], (x, p))

    def test_matches_argmin_of_pairwise(self):
        x, p = torch.randn(3, 8, 6, 6), torch.randn(12, 8)
        for metric in ["l2", "l1", "cosine"]:
            _, i = nearest_prototype(x, p, metric=metric)
            rows = x.permute(0, 2, 3, 1).reshape(-1, 8)
            want = pairwise_distance(x, p, metric=metric).argmin(1)
            assert_same_up_to_ties(rows, p, i.reshape(-1), want.reshape(-1), metric)


class TestBadInput:
    @pytest.mark.parametrize(
        ("x", "p", "kwargs", "error", "pattern"),
        [
            (torch.randn(2, 3, 4), torch.randn(5, 3), {}, ValueError, r"x must have shape \(N, D, H, W\)"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 3, 2), {}, ValueError, "prototypes must have shape"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 3, 2, 2), {}, ValueError, "prototypes must have shape"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 4), {}, ValueError, "prototypes must have D=3"),
            (torch.randn(1, 3, 4, 4), torch.randn(0, 3), {}, ValueError, "at least one prototype"),
            (torch.full((1, 3, 4, 4), float("nan")), torch.randn(5, 3), {}, ValueError, "x must hold only finite"),
            (torch.randn(1, 3, 4, 4), torch.full((5, 3), float("inf")), {}, ValueError, "prototypes must hold only"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 3), {"metric": "L3"}, ValueError, "metric must be one of"),
            (torch.ones(1, 3, 4, 4, dtype=torch.int64), torch.randn(5, 3), {}, TypeError, "x must hold floats"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 3), {"memory": 100}, ValueError, "cannot hold one tile"),
            (torch.randn(1, 3, 4, 4), torch.randn(5, 3), {"check_finite": "False"}, TypeError, "check_finite must be"),
        ],
    )
    def test_errors(self, x, p, kwargs, error, pattern):
        if x.numel() and p.shape[0]:  # empty inputs: pairwise_distance's output is empty too
            with pytest.raises(error, match=pattern):
                pairwise_distance(x, p, **kwargs)
        with pytest.raises(error, match=pattern):
            nearest_prototype(x, p, **kwargs)

    @pytest.mark.parametrize(("x_shape", "f"), [((0, 8, 5, 6), 4), ((2, 8, 0, 6), 4), ((2, 8, 5, 6), 0)])
    def test_empty_inputs_give_empty_outputs_as_cdist_does(self, x_shape, f):
        x = torch.randn(*x_shape, dtype=torch.float64, requires_grad=True)
        p = torch.randn(f, 8, dtype=torch.float64, requires_grad=True)
        got = pairwise_distance(x, p)
        n, _, h, w = x_shape
        want = torch.cdist(x.permute(0, 2, 3, 1).reshape(n, h * w, 8), p.expand(n, f, 8))
        assert got.shape == (n, f, h, w) and want.numel() == got.numel() == 0 and got.dtype == x.dtype
        got.sum().backward()  # gradients of the right shapes, as cdist's
        assert x.grad.shape == x.shape and p.grad.shape == p.shape

    def test_check_finite_can_be_switched_off(self):
        x = torch.full((1, 3, 2, 2), float("nan"))
        assert pairwise_distance(x, torch.randn(2, 3), check_finite=False).isnan().all()
        assert densematch.PrototypeDistance(2, 3)(x).isnan().all()

    def test_k_out_of_range(self):
        with pytest.raises(ValueError, match="k must be between 1 and 5"):
            nearest_prototype(torch.randn(1, 3, 2, 2), torch.randn(5, 3), k=6)


class TestCompiledKernel:
    @pytest.mark.parametrize("metric", ["l1", "linf"])
    @pytest.mark.parametrize("channels_last", [False, True])
    def test_compiled_forward_equals_reference_and_keeps_gradients(self, metric, channels_last):
        g = torch.Generator().manual_seed(9)
        x = torch.randn(2, 12, 7, 9, generator=g)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        p = torch.randn(10, 12, generator=g, requires_grad=True)
        d = pairwise_distance(x, p, metric=metric, compile=True)
        ref = broadcast_reference(x, p, metric)
        assert d.is_contiguous(memory_format=torch.channels_last) == channels_last
        torch.testing.assert_close(d.double(), ref, rtol=0, atol=1e-4 * ref.abs().max().item())
        w = torch.randn(d.shape, generator=g)
        ours = torch.autograd.grad((d * w).sum(), (x, p))
        want = torch.autograd.grad((pairwise_distance(x, p, metric=metric) * w).sum(), (x, p))
        for a, b in zip(ours, want, strict=True):
            torch.testing.assert_close(a, b)
        assert PrototypeDistance(10, 12, metric=metric, compile=True)(x.detach()).shape == (2, 10, 7, 9)


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 3, 0, 4), (2, 3, 4, 0)])
def test_empty_maps_give_empty_outputs_as_cdist_does(shape):
    x, p = torch.randn(*shape), torch.randn(5, 3)
    n, _, h, w = shape
    assert pairwise_distance(x, p).shape == (n, 5, h, w)
    value, index = nearest_prototype(x, p, k=2)
    assert value.shape == index.shape == (n, 2, h, w) and index.dtype == torch.int64
    assert nearest_prototype(x, p)[0].shape == (n, h, w)


@pytest.mark.parametrize("metric", ["l2", "cosine", "l1", "linf", "dot"])
def test_gradients_are_the_same_at_any_thread_count(metric):
    # tile boundaries and the order of the prototypes' sum depend on the budget alone
    x, p = torch.randn(2, 16, 40, 50), torch.randn(24, 16)
    weights = torch.linspace(0, 1, 2 * 24 * 40 * 50).view(2, 24, 40, 50)
    got = []
    for count in (1, 2):
        with torch_threads(count):
            xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
            out = pairwise_distance(xx, pp, metric=metric, memory="4MiB")
            (out * weights).sum().backward()
            got.append((out.detach(), xx.grad, pp.grad))
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other, strict=True))


def test_inference_tensors_are_taken_where_cdist_takes_them():
    with torch.inference_mode():
        x = torch.randn(1, 8, 4, 4)
    layer = PrototypeDistance(3, 8)
    with torch.inference_mode():  # cdist too takes them where nothing is recorded for backward
        assert layer(x).shape == (1, 3, 4, 4)
        assert layer.nearest(x)[0].shape == (1, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), pairwise_distance(x.clone(), layer.prototypes))
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        torch.cdist(x.flatten(2).transpose(1, 2), layer.prototypes[None])  # and refuses them here, as do we
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        layer(x)
