"""No silent wrong answers, no side effects: inputs at the edges, and calls that overlap in threads."""

import concurrent.futures
import contextvars
import math
import multiprocessing
import threading

import numpy as np
import pytest
import torch

import densematch
from densematch.engine.strategy import Strategy

from ._reference import assert_same_up_to_ties, assert_topk_exact, reference_scores, reported
from ._threads import torch_threads as _torch_threads


class TestInputs:
    def test_numpy_scalars_work_wherever_python_numbers_do(self):
        a, b = torch.randn(6, 7, 4), torch.randn(5, 6, 4)
        want = densematch.match(a, b, k=2, ratio=0.8, memory=2**20)
        got = densematch.match(a, b, k=np.int64(2), ratio=np.float32(0.8), memory=np.int64(2**20))
        assert torch.equal(got.index, want.index) and torch.equal(got.valid, want.valid)
        x, p = torch.randn(1, 4, 3, 3), torch.randn(5, 4)
        assert densematch.nearest_prototype(x, p, memory=np.int32(2**20))[1].shape == (1, 3, 3)

    @pytest.mark.parametrize(
        "make",
        [
            lambda: torch.randn(4, 4, 3).to_sparse(),
            lambda: torch.empty(4, 4, 3, device="meta"),
        ],
        ids=["sparse", "meta"],
    )
    def test_sparse_and_meta_tensors_are_refused(self, make):
        with pytest.raises(TypeError, match="a must"):
            densematch.match(make(), torch.randn(4, 4, 3))

    def test_complex_masks_are_refused(self):
        with pytest.raises(TypeError, match="mask_a must be a boolean mask"):
            densematch.match(torch.randn(3, 3, 2), torch.randn(3, 3, 2), mask_a=torch.ones(3, 3, dtype=torch.complex64))

    @pytest.mark.parametrize("shape", [(70000, 8), (1, 70000, 8), (3, 30000, 8), (2, 4, 300, 300)])
    def test_a_nan_or_inf_anywhere_is_found_by_the_checks_shared_out_chunks(self, shape):
        # on two threads check_finite cuts each leading slice's rows into shares for the workers
        # (at least 2^18 values each): the first value, the last, and one at a share's edge
        from densematch.checks import check_finite

        x = torch.zeros(shape)
        flat = x.view(-1)
        with _torch_threads(2):
            check_finite(x, "x")
            for at in (0, flat.numel() - 1, 2**18, flat.numel() // 2 + 1):
                for bad in (math.nan, math.inf):
                    flat[at] = bad
                    with pytest.raises(ValueError, match="x must hold only finite values"):
                        check_finite(x, "x")
                    rows = x.reshape(-1, shape[-1])
                    keep = torch.ones(rows.shape[0], dtype=torch.bool)
                    check_finite(rows, "x", mask=keep.index_fill(0, torch.tensor([at // shape[-1]]), False))
                    flat[at] = 0.0

    def test_nan_under_a_mask_is_never_read(self):
        # ragged batches padded with NaN under a mask: only the kept pixels must be finite
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(2, 5, 6, 3, generator=g), torch.randn(2, 4, 7, 3, generator=g)
        ma, mb = torch.ones(2, 5, 6, dtype=torch.bool), torch.ones(2, 4, 7, dtype=torch.bool)
        ma[1, 3:], mb[0, :, 5:] = False, False
        a[1, 3:], b[0, :, 5:] = float("nan"), float("inf")
        r = densematch.match(a, b, metric="l2", mask_a=ma, mask_b=mb, mutual=True)
        assert (r.index[1, 3:] == -1).all() and not r.score[ma].isnan().any()
        kept = r.coords[0, ..., 0] * 5 + r.coords[0, ..., 1]  # index among b's kept 4x5 pixels
        assert_topk_exact(a[0].reshape(-1, 3), b[0, :, :5].reshape(-1, 3), kept.reshape(-1, 1), "l2", 1)
        with pytest.raises(ValueError, match="b must hold only finite values"):
            densematch.match(a[:1], b[:1], mask_a=ma[:1])

    def test_float64_precision_reports_float64_scores(self):
        a, b = torch.randn(20, 5, dtype=torch.float64), torch.randn(30, 5, dtype=torch.float64)
        r = densematch.match(a, b, metric="l2", layout="flat", precision="float64")
        assert r.score.dtype == torch.float64
        torch.testing.assert_close(r.score, (a - b[r.index]).norm(dim=1), rtol=1e-12, atol=0)
        assert densematch.match(a, b, layout="flat").score.dtype == torch.float32


class TestNoProcessWideState:
    def test_default_settings_are_never_touched(self, monkeypatch):
        calls = []
        monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda v: calls.append(v))
        densematch.match(torch.randn(9, 9, 4), torch.randn(8, 8, 4))
        assert calls == []

    def test_overlapping_calls_in_threads_restore_the_callers_setting(self):
        saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium")
        start = threading.Barrier(4)
        seen = []
        real_rank = Strategy.finalise

        def spy(self, *args):
            seen.append(torch.get_float32_matmul_precision())
            return real_rank(self, *args)

        def one(seed):
            g = torch.Generator().manual_seed(seed)
            a, b = torch.randn(300, 16, generator=g), torch.randn(400, 16, generator=g)
            start.wait()
            return densematch.match(a, b, layout="flat", memory="256KiB").index

        try:
            Strategy.finalise = spy
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                results = list(pool.map(one, range(4)))
            after = torch.get_float32_matmul_precision()
        finally:
            Strategy.finalise = real_rank
            torch.set_float32_matmul_precision(saved)
        assert after == "medium"
        assert seen and set(seen) == {"highest"}  # every tile ran with IEEE products
        assert all(r.shape == (300,) for r in results)

    def test_config_context_reaches_a_thread_pool_through_copy_context(self):
        # contextvars do not follow work into threads; copy_context().run carries them
        def budget():
            return densematch.get_config()["memory"]

        with densematch.config_context(memory="3MiB"), concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(budget).result()
            carried = pool.submit(contextvars.copy_context().run, budget).result()
        assert (plain, carried) == (None, "3MiB")

    def test_config_context_reaches_densematchs_own_workers(self):
        # the engine's tiles run on worker threads: the caller's scoped settings must hold there
        seen = []
        with densematch.config_context(memory="5MiB", kernel="torch"):
            densematch.threads.share_out(range(6), lambda _: seen.append(densematch.get_config()), 2)
        assert len(seen) == 6 and all(c["memory"] == "5MiB" and c["kernel"] == "torch" for c in seen)

    def test_workers_are_kept_between_calls_and_run_again_in_a_forked_child(self):
        share_out = densematch.threads.share_out
        share_out(range(4), lambda _: None, 2)
        before = threading.active_count()
        names: list[str] = []
        for _ in range(5):
            share_out(range(4), lambda _: names.append(threading.current_thread().name), 2)
        assert threading.active_count() == before  # no thread started, none left behind
        assert set(names) <= {"densematch-0", "densematch-1"}
        # a forked child (data loaders, Ray) has none of the parent's threads: it starts its own
        if "fork" in multiprocessing.get_all_start_methods():
            with multiprocessing.get_context("fork").Pool(1) as pool:
                assert pool.apply_async(_match_in_a_child).get(timeout=120)

    def test_a_failing_item_raises_once_and_keeps_every_worker(self):
        share_out = densematch.threads.share_out

        def fail(i: int) -> None:
            if i == 3:
                raise ValueError("item 3")

        share_out(range(8), lambda _: None, 2)
        before = threading.active_count()
        for _ in range(4):
            with pytest.raises(ValueError, match="item 3"):
                share_out(range(8), fail, 2)
        assert threading.active_count() == before

    def test_scratch_buffers_do_not_outlive_a_call(self):
        def hold(_: int) -> None:
            densematch.threads.scratch("test", (1000,), torch.float32, torch.device("cpu"))
            kept.append(densematch.threads._buffers.__dict__.get("store"))

        kept: list[dict | None] = []
        densematch.threads.share_out(range(4), hold, 2)
        seen: list[dict | None] = []
        buffers = densematch.threads._buffers
        densematch.threads.share_out(range(4), lambda _: seen.append(buffers.__dict__.get("store")), 2)
        assert all(k for k in kept) and seen == [None] * 4

    def test_a_scratch_buffer_first_made_in_inference_mode_is_written_outside_it(self):
        # PrototypeDistance's l2 in C asked for its tiles inside inference mode, then a call with
        # no_grad wrote into the same buffers: an inference tensor refused the write
        name = "test-inference"
        with torch.inference_mode():
            inside = densematch.threads.scratch(name, (4,), torch.float32, torch.device("cpu"))
            torch.add(torch.zeros(4), 1, out=inside)
        outside = densematch.threads.scratch(name, (4,), torch.float32, torch.device("cpu"))
        torch.add(torch.zeros(4), 2, out=outside)
        assert outside.tolist() == [2.0] * 4 and not outside.is_inference()
        densematch.threads._buffers.__dict__["store"].pop(name)

    @pytest.mark.parametrize(
        "call",
        [
            lambda a, b: densematch.match(a, b),
            lambda a, b: densematch.match(a, b, precision="float32", k=8, mutual=True, ratio=0.9),
            lambda a, b: densematch.knn(a.reshape(-1, 8), b.reshape(-1, 8), k=8),
            lambda a, b: densematch.nearest_prototype(a.permute(2, 0, 1)[None], b[0, :40], k=8),
        ],
        ids=["match", "match-float32-mutual-ratio", "knn", "nearest_prototype"],
    )
    def test_a_threaded_search_wakes_none_of_the_callers_openmp_threads(self, monkeypatch, call):
        # Where a CPU search shares its tiles out over worker threads, an operator the caller
        # runs on its OpenMP team (before the search: the input checks; after: the results' own
        # passes) leaves that team spinning on the cores the workers take, about 10 ms of CPU a
        # call on a 2-core Zen 4 (benchmarks/history). Every kernel over at::internal::GRAIN_SIZE
        # elements on the calling thread must run with one intra-op thread.
        from torch.utils._python_dispatch import TorchDispatchMode

        grain = 32768
        caller = threading.current_thread()
        seen: list[str] = []

        class CallerKernels(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if threading.current_thread() is caller and torch.get_num_threads() > 1 and not func.is_view:
                    flat = [*args, *(out if isinstance(out, (tuple, list)) else [out])]
                    size = max((t.numel() for t in flat if isinstance(t, torch.Tensor)), default=0)
                    if size >= grain and not func.name().startswith(("aten::empty", "aten::new_empty", "aten::unbind")):
                        seen.append(f"{func.name()} over {size}")
                return out

        # 4096 query rows (past the rows a CPU search shares out), k=8: results of GRAIN_SIZE
        a = torch.rand(64, 64, 8)
        b = a + 0.01 * torch.rand(64, 64, 8)
        call(a, b)
        # (the mode is this thread's alone; densematch would take it for a trace and run unthreaded)
        monkeypatch.setattr(densematch._oprules, "is_in_torch_dispatch_mode", lambda: False)
        with _torch_threads(2), CallerKernels():
            assert densematch.engine.driver.tile_workers(a.device, 4096) == 2
            call(a, b)
        assert seen == []


def _match_in_a_child() -> bool:
    a = torch.arange(3 * 2500, dtype=torch.float32).reshape(2500, 3)  # long enough to share out
    return bool((densematch.match(a, a, metric="l2", layout="flat").index == torch.arange(2500)).all())


class TestWarpChecks:
    @pytest.mark.parametrize(
        ("args", "error", "pattern"),
        [
            ((0.0, 1.0, 0.0, 0.0), ValueError, "scale_h must be positive"),
            ((1.0, -1.0, 0.0, 0.0), ValueError, "scale_w must be positive"),
            ((float("nan"), 1.0, 0.0, 0.0), ValueError, "scale_h must be finite"),
            ((1.0, 1.0, float("inf"), 0.0), ValueError, "shift_y must be finite"),
            ((1.0, 1.0, 0.0, "2"), TypeError, "shift_x must be a real number"),
            ((1.0, 1.0, 0.0, True), TypeError, "shift_x must be a real number"),
            (
                (torch.ones(3), 1.0, 0.0, 0.0),
                ValueError,
                r"scale_h must be one number or one per image \(shape \(2,\)\)",
            ),
        ],
    )
    def test_bad_parameters(self, args, error, pattern):
        with pytest.raises(error, match=pattern):
            densematch.warp(torch.rand(2, 20, 20), *args, (8, 8))

    @pytest.mark.parametrize(
        ("image", "size", "error", "pattern"),
        [
            (torch.rand(20), (5, 5), ValueError, "image must have shape"),
            (torch.rand(20, 20), (0, 5), ValueError, "size must be a pair"),
            (torch.rand(20, 20), (5.0, 5), TypeError, "size must be a pair"),
            (torch.rand(20, 20), 5, TypeError, "size must be a pair"),
        ],
    )
    def test_bad_images_and_sizes(self, image, size, error, pattern):
        with pytest.raises(error, match=pattern):
            densematch.warp(image, 1.0, 1.0, 0.0, 0.0, size)

    def test_per_image_parameters_still_work(self):
        img = torch.rand(2, 20, 20)
        out = densematch.warp(img, torch.tensor([1.0, 1.5]), 1.0, np.float32(2.0), 0, (8, 8))
        torch.testing.assert_close(out[0], img[0, 2:10, :8])


def test_align_accepts_any_valid_scale_range():
    # scales up to 4.5 used to crash on a size mismatch (and still do on the code before the
    # fix, checked); large scales are searched in chunks
    g = torch.Generator().manual_seed(3)
    img = torch.nn.functional.avg_pool2d(torch.rand(1, 1, 40, 40, generator=g), 3, 1, 1)[0, 0]
    t = densematch.warp(img, 3.6, 3.1, 3.0, 1.5, (10, 12))
    a = densematch.align(t, img, scale_h=(3.0, 4.5), scale_w=(2.8, 4.5), objective="l2")
    assert abs(a.scale_h - 3.6) < 1e-3 and abs(a.scale_w - 3.1) < 1e-3
    assert abs(a.shift_y - 3.0) < 1e-2 and abs(a.shift_x - 1.5) < 1e-2


@pytest.fixture(scope="module")
def camera_pair():
    from skimage import data

    img = torch.from_numpy(data.camera()[180:300, 180:300].astype(np.float32) / 255)
    noise = 0.01 * torch.randn(60, 60, generator=torch.Generator().manual_seed(0))
    return densematch.warp(img, 1.1, 0.9, 4.25, 3.5, (60, 60)) + noise, img


FIELDS = ("scale_h", "scale_w", "shift_y", "shift_x")


@pytest.mark.parametrize("objective", ["l1", "l2", "ncc"])
def test_align_is_invariant_to_the_images_amplitude(camera_pair, objective):
    # fixed epsilons (the NCC denominator, the refinement's damping) once broke tiny or huge images
    t, img = camera_pair
    base = densematch.align(t, img, objective=objective)
    assert abs(base.scale_h - 1.1) < 2e-3 and abs(base.shift_y - 4.25) < 0.05
    power = {"l1": 1, "l2": 2, "ncc": 0}[objective]
    for c in (1e-6, 255.0, 1e6):
        r = densematch.align(c * t, c * img, objective=objective)
        for f in FIELDS:
            assert abs(getattr(r, f) - getattr(base, f)) < 1e-4, (c, f)
        assert r.error == pytest.approx(base.error * c**power, rel=1e-3)


@pytest.mark.parametrize("objective", ["l1", "ncc"])
def test_align_on_integer_images_matches_float(camera_pair, objective):
    t, img = camera_pair
    t255, img255 = (t.clamp(0, 1) * 255).round(), (img * 255).round()
    want = densematch.align(t255, img255, objective=objective)
    for dtype in (torch.int32, torch.int64, torch.int16):
        got = densematch.align(t255.to(dtype), img255.to(dtype), objective=objective)
        for f in FIELDS:
            assert abs(getattr(got, f) - getattr(want, f)) < 1e-4, (dtype, f)


@pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "dot", "cosine", "l1"])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-19, 1e19, 1e30])
def test_extreme_but_finite_features_rank_as_unit_ones(metric, magnitude):
    # a common scale changes no ranking: the answer at 1e19 is the answer at 1, never NaN
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(10, 10, 64, generator=g), torch.randn(10, 10, 64, generator=g)
    want = densematch.match(a, b, metric=metric, k=2)
    got = densematch.match(a * magnitude, b * magnitude, metric=metric, k=2)
    fa, fb = a.reshape(-1, 64), b.reshape(-1, 64)
    assert_same_up_to_ties(fa, fb, got.index, want.index, metric)
    degree = {"cosine": 0, "dot": 2, "sqeuclidean": 2}.get(metric, 1)
    chosen = reported(reference_scores(fa, fb, metric), metric).gather(1, got.index.reshape(-1, 2))
    expected = chosen.reshape(got.score.shape) * magnitude**degree
    info = torch.finfo(torch.float32)
    normal = (expected.abs() < info.max) & (expected.abs() > info.tiny)
    assert not got.score.isnan().any()
    torch.testing.assert_close(got.score.double()[normal], expected[normal], rtol=1e-5, atol=0)
    # past float32's range, inf; below it, (nearly) 0: as float32 rounds the true values
    assert got.score[expected.abs() >= info.max].isinf().all()
    assert (got.score.double()[expected.abs() <= info.tiny].abs() <= info.tiny).all()


def test_float64_features_beyond_float32s_range():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randn(50, 8, generator=g, dtype=torch.float64)
    want = densematch.match(a, b, metric="l2", layout="flat")
    got = densematch.match(a * 1e300, b * 1e300, metric="l2", layout="flat")
    assert (got.index >= 0).all()
    assert_same_up_to_ties(a, b, got.index, want.index, "l2")
    exact = densematch.match(a * 1e300, b * 1e300, metric="l2", layout="flat", precision="float64")
    torch.testing.assert_close(exact.score, (a - b[exact.index]).norm(dim=1) * 1e300, rtol=1e-5, atol=0)


def test_cosine_distances_treat_only_exact_zeros_as_zero_vectors():
    # the full distance tensor and its gradient follow the same rule as the search
    g = torch.Generator().manual_seed(5)
    x, p = torch.randn(1, 8, 4, 5, generator=g), torch.randn(6, 8, generator=g)
    tiny = (x * 1e-25).requires_grad_()
    want = densematch.pairwise_distance(x.requires_grad_(), p, metric="cosine")
    got = densematch.pairwise_distance(tiny, p, metric="cosine")
    torch.testing.assert_close(got, want)
    (gx,) = torch.autograd.grad(got.sum(), tiny)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx * 1e-25, wx, rtol=1e-4, atol=1e-6)  # d/d(cx) = (d/dx) / c


def test_cosine_treats_only_exact_zeros_as_zero_vectors():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(30, 16, generator=g), torch.randn(40, 16, generator=g)
    tiny = a.clone()
    tiny[::3] *= 1e-25  # norms far below 1e-12, still well inside float32
    tiny[1] = 0.0
    want = densematch.match(a, b, layout="flat")
    got = densematch.match(tiny, b, layout="flat")
    rows = torch.arange(30) != 1
    assert_same_up_to_ties(a[rows], b, got.index[rows], want.index[rows], "cosine")
    direct = reference_scores(a, b, "cosine").gather(1, got.index[:, None])[:, 0]
    torch.testing.assert_close(got.score[rows].double(), direct[rows], rtol=0, atol=1e-6)
    assert got.score[1] == 0 and got.index[1] == 0  # a zero vector scores 0 everywhere: ties to 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(stride=float("inf")), "stride must be a finite number"),
        (dict(stride=(1.0, float("nan"))), "stride must be a finite number"),
        (dict(offset=float("-inf")), "offset must be a finite number"),
        (dict(ratio=0.9, exclude_radius=float("inf")), "exclude_radius must be a finite number"),
        (dict(ratio=float("nan")), "ratio must be a finite number"),
    ],
)
def test_infinite_placing_settings_are_refused(kwargs, pattern):
    a, b = torch.randn(6, 7, 4), torch.randn(5, 8, 4)
    with pytest.raises(ValueError, match=pattern):
        densematch.match(a, b, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        densematch.DenseMatcher(**kwargs)


def test_an_exclude_radius_past_the_grid_means_no_runner_up():
    a, b = torch.randn(6, 7, 4), torch.randn(5, 8, 4)
    whole = densematch.match(a, b, ratio=0.9, exclude_radius=20.0)  # b's diagonal is 9.4
    for radius in (1e6, 1e300):
        r = densematch.match(a, b, ratio=0.9, exclude_radius=radius)
        assert torch.equal(r.valid, whole.valid) and torch.equal(r.index, whole.index)
    assert whole.valid.all()  # no runner-up farther than the radius: every pixel passes
