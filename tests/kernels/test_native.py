"""The C kernels of densematch.kernels.native against float64 references, and the fallback to
torch's kernels where they cannot run."""

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import densematch
from densematch.kernels import c_align, c_engine, c_local, loader, native

from .._reference import assert_sums_close, minkowski_reference
from .._threads import torch_threads

# where no compiler exists the kernels cannot be built; TestBuild and TestCallers still run there
needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")


@needs_library
class TestMinkowski:
    @settings(max_examples=60, deadline=None)
    @given(
        f=st.integers(1, 11),
        d=st.integers(1, 40),
        p=st.integers(1, 50),
        linf=st.booleans(),
        dtype=st.sampled_from([torch.float32, torch.float64]),
        seed=st.integers(0, 2**16),
    )
    def test_equals_float64_reference(self, f, d, p, linf, dtype, seed):
        # sizes around the register blocks (4 rows, 16 or 8 columns) and their tails
        g = torch.Generator().manual_seed(seed)
        y = torch.randn(f, d, generator=g, dtype=dtype)
        x = torch.randn(d, p, generator=g, dtype=dtype)
        out = torch.full((f, p), float("nan"), dtype=dtype)
        native.minkowski(y, x, out, linf=linf)
        assert_sums_close(out, minkowski_reference(y, x, linf), d, dtype)

    def test_strided_operands_and_scale(self):
        g = torch.Generator().manual_seed(1)
        y = torch.randn(7, 30, generator=g)[:, ::2]  # (7, 15), row stride 30
        big = torch.randn(15, 70, generator=g)
        x = big[:, 3:40]  # (15, 37), row stride 70
        out = torch.zeros(37, 7).T  # (7, 37) written through strides (1, 7)
        native.minkowski(y, x, out, linf=False, scale=-1.0)
        assert_sums_close(-out, minkowski_reference(y, x, False), 15, torch.float32)
        xt = big.T[3:40].T  # unit stride along the rows missing: copied inside
        native.minkowski(y, xt, out, linf=True)
        assert_sums_close(out, minkowski_reference(y, x, True), 15, torch.float32)

    def test_nan_propagates(self):
        y = torch.randn(5, 6)
        x = torch.randn(6, 20)
        x[2, 3] = float("nan")
        for linf in (False, True):
            out = torch.empty(5, 20)
            native.minkowski(y, x, out, linf=linf)
            assert out[:, 3].isnan().all() and not out[:, :3].isnan().any()

    @pytest.mark.parametrize("linf", [False, True])
    def test_gradient_equals_autograd_of_the_reference(self, linf):
        g = torch.Generator().manual_seed(2)
        y = torch.randn(9, 13, dtype=torch.float64, generator=g)
        x = torch.randn(13, 35, dtype=torch.float64, generator=g)
        x[:, 5] = y[1]  # a zero distance: sign 0 everywhere, as torch.cdist's gradient
        x[4, 6] = y[2, 4]  # one zero difference
        w = torch.randn(9, 35, dtype=torch.float64, generator=g)
        dist = torch.empty(9, 35, dtype=torch.float64)
        native.minkowski(y, x, dist, linf=linf)
        gx, gy = native.minkowski_grad(y, x, w, dist, linf=linf)
        yr, xr = y.clone().requires_grad_(), x.clone().requires_grad_()
        ref = torch.cdist(yr, xr.T, p=float("inf") if linf else 1.0)
        want_y, want_x = torch.autograd.grad((ref * w).sum(), (yr, xr))
        torch.testing.assert_close(gx, want_x)
        torch.testing.assert_close(gy, want_y)


@needs_library
class TestL2Passes:
    def test_finish_sqnorms_and_weights(self):
        g = torch.Generator().manual_seed(3)
        body = torch.randn(21, 8, generator=g, dtype=torch.float64)
        xc = torch.randn(8, 45, generator=g, dtype=torch.float64)
        xc[:, 7] = body[4]  # a zero distance
        xx = native.sqnorms(xc)
        torch.testing.assert_close(xx, xc.square().sum(0))
        want = torch.cdist(body, xc.T)
        for root in (True, False):
            out = torch.empty(45, 21, dtype=torch.float64).T  # strided output
            smallest = native.l2_finish(body @ xc, body.square().sum(1), xx, out, root=root)
            torch.testing.assert_close(out, want if root else want.square())
            assert (out >= 0).all() and smallest[7] < 1e-12
            gout = torch.randn(21, 45, generator=g, dtype=torch.float64)
            w, per_col, per_row = native.l2_weights(gout, out, torch.empty(21, 45, dtype=torch.float64), root=root)
            expect = torch.where(out == 0, 0.0, gout / out) if root else gout
            torch.testing.assert_close(w, expect)
            torch.testing.assert_close(per_col, expect.sum(0))
            torch.testing.assert_close(per_row, expect.sum(1))
        # an expanded gradient (stride 0), as a sum's backward passes
        ones = torch.ones(()).expand(21, 45).double()
        w, per_col, _ = native.l2_weights(ones, out, torch.empty(21, 45, dtype=torch.float64), root=False)
        assert (w == 1).all() and (per_col == 21).all()

    def test_finish_keeps_nan(self):
        t = torch.tensor([[float("nan"), 1.0]])
        out = torch.empty(1, 2)
        native.l2_finish(t, torch.zeros(1), torch.full((2,), 5.0), out, root=True)
        assert out[0, 0].isnan() and out[0, 1] == pytest.approx(3**0.5)


def pair_reference(q: torch.Tensor, r: torch.Tensor, idx: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, k) values of the pairs (q[i], r[idx[i, j]]) in float64, and the sums of their terms'
    magnitudes (what a float rounding error is relative to)."""
    a, b = q.double()[:, None, :], r.double()[idx]
    if kind in ("dot", "cosine"):
        if kind == "cosine":
            a, b = torch.nn.functional.normalize(a, dim=-1), torch.nn.functional.normalize(b, dim=-1)
        return (a * b).sum(-1), (a * b).abs().sum(-1)
    d = (a - b).abs()
    want = d.amax(-1) if kind == "maxabs" else d.square().sum(-1) if kind == "sqdiff" else d.sum(-1)
    return want, want


@needs_library
class TestPairValues:
    @settings(max_examples=80, deadline=None)
    @given(
        m=st.integers(1, 6),
        k=st.integers(1, 5),
        c=st.integers(1, 41),
        kind=st.sampled_from(sorted(native.PAIR_KINDS)),
        dtype=st.sampled_from([torch.float32, torch.float64]),
        seed=st.integers(0, 2**16),
    )
    def test_equals_float64_reference(self, m, k, c, kind, dtype, seed):
        # lengths around the vectors (16 float32 or 8 float64 values per step) and their tails
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(m, c, generator=g, dtype=dtype)
        r = torch.randn(9, c, generator=g, dtype=dtype)
        idx = torch.randint(0, 9, (m, k), generator=g)
        got = native.pair_values(q, r, idx, kind)
        want, size = pair_reference(q, r, idx, kind)
        assert ((got.double() - want).abs() <= (c + 4) * torch.finfo(dtype).eps * size).all()
        # the same pairs with their query rows named, from a matrix of other rows too
        more = torch.cat([torch.randn(4, c, generator=g, dtype=dtype), q])
        named = native.pair_values(more, r, idx, kind, q_rows=torch.arange(4, 4 + m))
        assert torch.equal(named, got)

    def test_equal_rows_give_equal_values_wherever_they_sit(self):
        g = torch.Generator().manual_seed(7)
        q = torch.randn(3, 37, generator=g)
        r = torch.randn(6, 37, generator=g)
        r[4] = r[1]
        strided = torch.randn(6, 74, generator=g)[:, ::2]  # rows not unit-stride: gathered inside
        strided[2] = r[1]
        queries = torch.randn(74, 3, generator=g)[::2].T  # (3, 37), column-major
        queries.copy_(q)
        idx = torch.tensor([[1, 4, 1], [4, 0, 1], [5, 4, 1]])
        same = (idx == 1) | (idx == 4)
        for kind in native.PAIR_KINDS:
            v = native.pair_values(q, r, idx, kind)
            w = native.pair_values(queries, strided, torch.full((3, 1), 2), kind, q_rows=torch.arange(3))
            for i in range(3):
                assert (v[i][same[i]] == w[i, 0]).all(), kind

    def test_nan_zero_and_extreme_rows(self):
        r = torch.ones(5, 20)
        r[0, 17] = float("nan")  # in the tail of float32's 16-value steps
        r[1, 3] = float("nan")
        r[2] = 0.0
        r[3] = 1e-42  # subnormal: scaled into range exactly
        r[4] = 3e38  # near float32's largest: squares would overflow unscaled
        q = r[2:].clone()  # zero, subnormal and huge query rows too
        idx = torch.arange(5).expand(3, 5)
        cos = native.pair_values(q, r, idx, "cosine")
        assert cos[:, :2].isnan().all() and (cos[0, 2:] == 0).all() and (cos[:, 2] == 0).all()
        torch.testing.assert_close(cos[1:, 3:], torch.ones(2, 2))
        nan_query = torch.full((1, 20), float("nan"))
        assert native.pair_values(nan_query, r, idx[:1], "cosine").isnan().all()
        for kind in ("dot", "sqdiff", "absdiff", "maxabs"):
            v = native.pair_values(q[:1], r[:2], idx[:1, :2], kind)
            assert v.isnan().all(), kind


class TestCallers:
    @pytest.mark.parametrize("metric", ["l2", "sqeuclidean", "l1", "linf"])
    @pytest.mark.parametrize("channels_last", [False, True])
    def test_distances_and_gradients_equal_torch_kernels(self, metric, channels_last):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(2, 10, 13, 7, generator=g)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        p = torch.randn(11, 10, generator=g, requires_grad=True)
        w = torch.randn(2, 11, 13, 7, generator=g)
        results = []
        for kernel in ("auto", "torch"):
            with densematch.config_context(kernel=kernel):
                d = densematch.pairwise_distance(x, p, metric=metric, memory="64KiB")
                results.append((d, *torch.autograd.grad((d * w).sum(), (x, p))))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("metric", ["l1", "linf"])
    def test_match_and_nearest_prototype_search_with_them(self, metric):
        from .._reference import assert_topk_exact

        g = torch.Generator().manual_seed(5)
        a = torch.randn(300, 12, generator=g)
        b = torch.randn(350, 12, generator=g)
        m = densematch.match(a.reshape(15, 20, 12), b.reshape(14, 25, 12), metric=metric, k=3, memory="256KiB")
        assert_topk_exact(a, b, m.index.reshape(300, 3), metric, 3)
        d, i = densematch.nearest_prototype(a.T.reshape(1, 12, 15, 20), b, metric=metric, k=2)
        index = i.reshape(2, 300).T
        assert_topk_exact(a, b, index, metric, 2)
        want = minkowski_reference(a, b.T, metric == "linf").gather(1, index)
        assert_sums_close(d.reshape(2, 300).T, want, 12, torch.float32)

    def test_tiles_and_threads_do_not_change_a_distance(self):
        # every distance sums its features in one order, whatever tile or worker computed it
        g = torch.Generator().manual_seed(6)
        x = torch.randn(3, 20, 17, 19, generator=g)
        p = torch.randn(40, 20, generator=g)
        whole = densematch.pairwise_distance(x, p, metric="l1")
        with torch_threads(1):
            tiled = densematch.pairwise_distance(x, p, metric="l1", memory="40KiB")
        assert torch.equal(whole, tiled)


def test_prototype_gradient_does_not_depend_on_which_worker_finishes_first(monkeypatch):
    # the tiles' parts of the prototypes' gradient are added in tile order, whatever the timing
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 30, 30, generator=g, requires_grad=True)
    p = torch.randn(24, 16, generator=g, requires_grad=True)
    w = torch.randn(2, 24, 30, 30, generator=g)
    original = densematch.metrics.Minkowski.bank_grads
    calls = []

    def late_every_third(self, bank, xt, gt, dt, **kwargs):
        calls.append(None)
        if len(calls) % 3 == 1:
            time.sleep(0.003)
        return original(self, bank, xt, gt, dt, **kwargs)

    grads = []
    for patched in (False, True):
        if patched:
            monkeypatch.setattr(densematch.metrics.Minkowski, "bank_grads", late_every_third)
        d = densematch.pairwise_distance(x, p, metric="l1", memory="96KiB")
        grads.append(torch.autograd.grad((d * w).sum(), p)[0])
    assert len(calls) > 3 and torch.equal(grads[0], grads[1])


@needs_library
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="manylinux tags are Linux's")
def test_the_wheel_is_tagged_manylinux_from_what_its_libraries_need(tmp_path):
    import platform

    from packaging import tags

    from densematch.kernels import wheeltag

    library = Path(native.status()["library"])
    loaded, versions = wheeltag.needs(library)
    assert loaded <= wheeltag.ALLOWED and (2, 2) <= max(versions) <= (2, 17)  # glibc 2.16 today
    arch = platform.machine()
    tag = wheeltag.platform_tag([library], f"linux_{arch}")
    assert tag == f"manylinux_2_17_{arch}"
    assert tag in {t.platform for t in tags.sys_tags()}  # what pip installs here
    # a library that loads more than the policies allow keeps the build's own tag, as does
    # anything this cannot read
    torch_lib = next(p for p in (Path(torch.__file__).parent / "lib").glob("libtorch_cpu*.so*"))
    assert not wheeltag.needs(torch_lib)[0] <= wheeltag.ALLOWED
    assert wheeltag.platform_tag([library, torch_lib], f"linux_{arch}") == f"linux_{arch}"
    (tmp_path / "not-elf.so").write_bytes(b"#!/bin/sh\n")
    assert wheeltag.platform_tag([tmp_path / "not-elf.so"], f"linux_{arch}") == f"linux_{arch}"
    assert wheeltag.platform_tag([library], "macosx_11_0_arm64") == "macosx_11_0_arm64"


class TestBuild:
    def test_cc_names_the_compiler_or_none(self, monkeypatch):
        # CC=/nonexistent fell back to gcc on the PATH: a build that was asked for no compiler
        # got one
        from densematch.kernels import build

        monkeypatch.setenv("CC", "/nonexistent")
        assert build.compiler() is None
        monkeypatch.setenv("CC", sys.executable)  # any program that runs counts as named
        assert build.compiler() == sys.executable
        monkeypatch.delenv("CC")
        assert build.compiler() == (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))

    def test_a_failed_build_raises_and_leaves_nothing(self, tmp_path, monkeypatch):
        monkeypatch.setenv("DENSEMATCH_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
        with pytest.raises(RuntimeError, match=r"failed on native\.c"):
            native.build()
        assert list(tmp_path.iterdir()) == []

    @needs_library
    def test_builds_once_into_the_cache_and_rebuilds_a_library_cut_short(self, tmp_path, monkeypatch):
        from densematch.kernels import build

        # this process's own build, copied into a fresh cache: found whole there, not built again
        # (the rebuild below compiles, so one compilation covers both)
        source = native.build()
        monkeypatch.setenv("DENSEMATCH_CACHE", str(tmp_path))
        path = loader._cached_path(build.compiler())
        for suffix in (path.suffix, ".sha256"):
            shutil.copy(source.with_suffix(suffix), path.with_suffix(suffix))
        stamp = path.stat().st_mtime_ns
        assert native.build() == path and path.parent == tmp_path
        assert native.build() == path and path.stat().st_mtime_ns == stamp
        assert sorted(q.name for q in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".sha256").name])
        # a truncated library used to be mapped by ctypes and kill every later process (SIGBUS)
        code = (
            "import torch, densematch\n"
            "from densematch.kernels import native\n"
            "assert native.library() is not None\n"
            "x, p = torch.randn(1, 4, 3, 3), torch.randn(5, 4)\n"
            "d = densematch.pairwise_distance(x, p, 'l1')\n"
            "ref = torch.cdist(x.flatten(2)[0].T, p, p=1.0).T.reshape(5, 3, 3)\n"
            "torch.testing.assert_close(d[0], ref)\n"
        )
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 3])
        env = {**os.environ, "DENSEMATCH_CACHE": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert path.read_bytes() == whole  # rebuilt in place

    @pytest.fixture(scope="class")
    def shipped_package(self, tmp_path_factory):
        """A copy of the densematch package with every level's library built in (the package
        build, compiled once for the tests that load it), as the environment a process needs to
        import it: PYTHONPATH, an unused cache and no compiler."""
        from densematch.kernels import build

        root = tmp_path_factory.mktemp("shipped")
        package = root / "densematch"
        shutil.copytree(Path(densematch.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        built = build.build_all(package / "kernels")
        assert [p.name for p in built] == [build.library_name(level) for level in build.levels()]
        return {"PYTHONPATH": str(root), "DENSEMATCH_CACHE": str(root / "cache"), "CC": "false"}

    @needs_library
    def test_every_level_this_cpu_runs_computes_the_same_bits(self, shipped_package):
        # -ffp-contract=off and the kernels' fixed vector width: an AVX-512 machine and an AVX2 one
        # (or one without FMA) give the same distances, gradients and pair values, to the last bit
        from densematch.kernels import build

        # every level this CPU runs, its highest down to the baseline (no FMA, no AVX): each has
        # its own vector code (AVX-512's min and max, AVX2's halves, portable lanes)
        runnable = list(build.levels()[build.levels().index(build.level()) :])
        code = (
            "import hashlib, torch, densematch\n"
            "from densematch.kernels import native\n"
            "g = torch.Generator().manual_seed(3)\n"
            "x = torch.randn(2, 37, 9, 11, generator=g, requires_grad=True)\n"
            "p = torch.randn(13, 37, generator=g, requires_grad=True)\n"
            "h = hashlib.sha256()\n"
            "for metric in ('l1', 'linf', 'l2'):\n"
            "    d = densematch.pairwise_distance(x, p, metric)\n"
            "    gx, gp = torch.autograd.grad(d.square().sum(), (x, p))\n"
            "    for t in (d, gx, gp):\n"
            "        h.update(t.detach().numpy().tobytes())\n"
            "q, r = torch.randn(50, 37, generator=g), torch.randn(60, 37, generator=g)\n"
            "idx = torch.randint(0, 60, (50, 4), generator=g)\n"
            "for kind in ('sqdiff', 'absdiff', 'maxabs', 'dot', 'cosine'):\n"
            "    h.update(native.pair_values(q, r, idx, kind).numpy().tobytes())\n"
            # align's refinement: two channels, uneven weights, with and without gain and bias
            "t, xs = torch.rand(1, 2, 20, 24, generator=g).double(), torch.rand(1, 2, 26, 30, generator=g).double()\n"
            "w = torch.rand(1, 20, 24, generator=g).double() + 0.2\n"
            "for n in (4, 6):\n"
            "    start = torch.tensor([[1.05, 0.97, 2.3, 3.1, 1.0, 0.0][:n]], dtype=torch.float64)\n"
            "    for v in native.align_refine(t, xs, w, torch.zeros(1), start, (0.8, 1.2, 0.8, 1.2), 25, 1e-3):\n"
            "        h.update(v.numpy().tobytes())\n"
            # align's grid: the cross term (vectors of row shifts, two blocks and a tail), scores and best shifts
            "from densematch.alignment.warp import bilinear_taps\n"
            "a, tt = torch.rand(2, 2, 3, 30, 17, generator=g), torch.rand(2, 2, 11, 9, generator=g)\n"
            "i0, i1, w0, w1 = bilinear_taps(20, 17, torch.tensor([0.8, 1.0, 1.2]), torch.zeros(3))\n"
            "for dt in (torch.float32, torch.float64):\n"
            "    out = native.align_cross(a.to(dt), tt.to(dt), (i0, i1, w0.to(dt), w1.to(dt)), (20, 12))\n"
            "    h.update(out.numpy().tobytes())\n"
            "    for ncc in (False, True):\n"
            "        out = native.align_scores(a.to(dt), tt.to(dt), (i0, i1, w0.to(dt), w1.to(dt)), (20, 12), ncc)\n"
            "        h.update(out.numpy().tobytes())\n"
            "        r0, r1, v0, v1 = bilinear_taps(30, 26, torch.tensor([0.9, 1.0, 1.15]), torch.zeros(3))\n"
            "        lim = (torch.tensor([20, 5, 0]), torch.tensor([11, 11, 3]))\n"
            "        rows = (r0, r1, v0.to(dt), v1.to(dt))\n"
            "        xs = a[:, :, 0, :26].to(dt).contiguous()\n"
            "        cols = (i0, i1, w0.to(dt), w1.to(dt))\n"
            "        for v in native.align_grid(xs, tt.to(dt), rows, cols, (20, 12), *lim, ncc, 3):\n"
            "            h.update(v.numpy().tobytes())\n"
            "q = torch.tensor([[0.83, 1.17, 1.4, 6.25], [1.2, 0.8, 7.6, 3.0]], dtype=torch.float64)\n"
            "for dt in (torch.float32, torch.float64):\n"
            "    h.update(native.align_warp(a[:, :, 0].to(dt).contiguous(), q, (21, 11)).numpy().tobytes())\n"
            "gh = torch.linspace(0.8, 1.2, 5, dtype=torch.float64)\n"
            "bb, ww = torch.rand(2, 5, 5, 3, generator=g), torch.randint(0, 40, (2, 5, 5, 3), generator=g)\n"
            "h.update(native.align_pick(bb, ww, gh, gh, 8, (0.15, 0.15, 2.0, 2.0), 64, 8).numpy().tobytes())\n"
            "for v in native.align_best_shifts(torch.rand(4, 13, 13, generator=g), 3):\n"
            "    h.update(v.numpy().tobytes())\n"
            # align's whole search (native.align_search), with gain and bias too
            "img = torch.rand(56, 60, generator=g)\n"
            "tpl = densematch.warp(img, 1.1, 0.9, 3.25, 2.5, (44, 40))\n"
            "for objective in ('l1', 'ncc'):\n"
            "    a = densematch.align(tpl, img, objective=objective)\n"
            "    h.update(repr((a.scale_h, a.scale_w, a.shift_y, a.shift_x, a.error)).encode())\n"
            "    h.update(a.warped.numpy().tobytes() + a.landscape.numpy().tobytes())\n"
            # certify_alignment's bound: both ranges, both objectives, whole sums
            "cells = torch.tensor([[1.02, 0.95, 2.5, 3.5], [0.9, 1.1, 0.2, 4.0]], dtype=torch.float64)\n"
            "for exact in (False, True):\n"
            "    for sq in (False, True):\n"
            "        for half in ((0.01, 0.02, 0.7, 0.3), (0.03, 0.03, 2.0, 1.5)):\n"
            "            sums = torch.empty(2, 20, dtype=torch.float64)\n"
            "            b = native.certify_bound(xs[0], t[0], cells, half, torch.arange(20), pivot=(9.5, 4.0),\n"
            "                                     exact=exact, squared=sq, stop=float('inf'), row_sums=sums)\n"
            "            h.update(b.numpy().tobytes() + sums.numpy().tobytes())\n"
            # and from floors (half each row's sum), stopped at the smaller whole sum
            "            b = native.certify_bound(xs[0], t[0], cells, half, torch.arange(20), pivot=(9.5, 4.0),\n"
            "                                     exact=exact, squared=sq, stop=float(b.min()), floors=sums / 2)\n"
            "            h.update(b.numpy().tobytes())\n"
            # the level rule's band share (align_band), both dtypes
            "from densematch.alignment.api import _band_dft, _window\n"
            "for dt in (torch.float32, torch.float64):\n"
            "    share = native.align_band(tpl[None, None].to(dt), _window(44, 40), *_band_dft(44, 40, 2))\n"
            "    h.update(repr(share).encode())\n"
            # the certified bfloat16 step: whole chunks (AVX2's lanes or the portable ones) and a tail
            "hb = torch.randn(40, 100, generator=g).bfloat16()\n"
            "hb[3, 50] = float('nan')\n"
            "qt, rt = torch.rand(40, 3, generator=g) * 1e-2, torch.rand(100, 3, generator=g) * 1e-2\n"
            "qt[:, 2] = 1\n"
            "for k in (1, 8):\n"
            "    bv, bi = torch.full((40, k), -float('inf')), torch.full((40, k), -1, dtype=torch.int64)\n"
            "    listed = native.Candidates(40, 16, torch.float32)\n"
            "    native.merge_certified(hb, 0, bv, bi, qt, rt, torch.randn(100, generator=g), 2**-8, listed)\n"
            "    for t in (bv, bi, listed.over, *listed.reaching(torch.full((40,), -float('inf')))):\n"
            "        h.update(t.numpy().tobytes())\n"
            # and with groups, from a column inside a group (a head pair by pair, chunks, a tail)
            "    bv, bi = torch.full((40, k), -float('inf')), torch.full((40, k), -1, dtype=torch.int64)\n"
            "    listed = native.Candidates(40, 16, torch.float32)\n"
            "    groups = (torch.randn(40, 4, generator=g), torch.rand(40, 5, generator=g) * 1e-3,\n"
            "              torch.rand(4, 3, generator=g))\n"
            "    native.merge_certified(hb, 7, bv, bi, qt, rt, torch.randn(100, generator=g), 2**-8, listed, groups)\n"
            "    for t in (bv, bi, listed.over, *listed.reaching(torch.full((40,), -float('inf')))):\n"
            "        h.update(t.numpy().tobytes())\n"
            # a wide tile: each row's first tile seeded from its chunks' lower bounds, and lanes
            # listed a chunk at once (AVX-512) or one by one
            "hb = (torch.randn(24, 700, generator=g) * 4).round().bfloat16()\n"
            "qt, rt = torch.rand(24, 3, generator=g) * 1e-2, torch.rand(700, 3, generator=g) * 1e-2\n"
            "for k in (1, 8):\n"
            "    bv, bi = torch.full((24, k), -float('inf')), torch.full((24, k), -1, dtype=torch.int64)\n"
            "    listed = native.Candidates(24, 200, torch.float32)\n"
            "    for j in (0, 350):\n"
            "        native.merge_certified(hb[:, j:j + 350], j, bv, bi, qt, rt[j:j + 350], None, 2**-8, listed)\n"
            "    for t in (bv, bi, listed.over, *listed.reaching(torch.full((24,), -float('inf')))):\n"
            "        h.update(t.numpy().tobytes())\n"
            # the references' groups in one pass: a short last group, an extra column, a tail of columns
            "rr = torch.randn(75, 21, generator=g) * 3 + 10\n"
            "hh = torch.empty(75, 21, dtype=torch.bfloat16)\n"
            "for t in (*native.group_rows(rr, 20, hh), hh.view(torch.int16)):\n"
            "    h.update(t.numpy().tobytes())\n"
            "print(native.status()['level'], h.hexdigest())\n"
        )
        # the levels side by side: this CPU's own level loads the run-time build this process
        # uses (its cache, tuned for this CPU), the others the package build's libraries
        own = {**os.environ}
        running = {
            level: subprocess.Popen(
                [sys.executable, "-c", code],
                env={**own, "DENSEMATCH_NATIVE_LEVEL": level}
                if level == build.level()
                else {**own, **shipped_package, "DENSEMATCH_NATIVE_LEVEL": level},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for level in runnable
        }
        digests = {}
        for level, proc in running.items():
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err
            loaded, digest = out.split()
            assert loaded == level
            digests[level] = digest
        assert len(set(digests.values())) == 1, digests

    @needs_library
    def test_the_package_ships_one_library_per_level_and_loads_it(self, shipped_package):
        from densematch.kernels import build

        # the copied package, loaded on its own: the shipped library is the one used, and no
        # compiler is needed for it
        package = Path(shipped_package["PYTHONPATH"]) / "densematch"
        kernels = package / "kernels"
        assert sorted(p.name for p in kernels.glob("_native-*")) == sorted(
            [build.library_name(level) for level in build.levels()]
            + [Path(build.library_name(level)).with_suffix(".sha256").name for level in build.levels()]
        )
        code = (
            "from densematch.kernels import native\n"
            "assert native.library() is not None\n"
            "print(native.status()['built'], native.status()['library'])\n"
        )
        env = {**os.environ, **shipped_package}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("with the package") and str(kernels) in done.stdout
        assert not Path(shipped_package["DENSEMATCH_CACHE"]).exists()

    def test_without_a_compiler_a_warning_says_so_once(self, tmp_path):
        env = {**os.environ, "DENSEMATCH_CACHE": str(tmp_path), "CC": "false"}
        code = (
            "import warnings, torch, densematch\n"
            "from densematch.kernels import native\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    for _ in range(3):\n"
            "        densematch.pairwise_distance(torch.randn(1, 4, 3, 3), torch.randn(5, 4), 'l1')\n"
            "said = [w for w in caught if 'C kernels are unavailable' in str(w.message)]\n"
            "assert len(said) == 1 and said[0].category is RuntimeWarning, [str(w.message) for w in caught]\n"
            "assert 'failed on native.c' in native.status()['kernels'], native.status()\n"
        )
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

    def test_switched_off_falls_back_to_torch(self):
        code = (
            "import torch, densematch\n"
            "from densematch.kernels import native\n"
            "assert native.library() is None and not native.usable(torch.device('cpu'), torch.float32)\n"
            "x, p = torch.randn(1, 4, 3, 3), torch.randn(5, 4)\n"
            "d = densematch.pairwise_distance(x, p, 'l1')\n"
            "ref = torch.cdist(x.flatten(2)[0].T, p, p=1.0).T.reshape(5, 3, 3)\n"
            "torch.testing.assert_close(d[0], ref)\n"
        )
        env = {**os.environ, "DENSEMATCH_NATIVE": "0"}
        subprocess.run([sys.executable, "-c", code], env=env, check=True)


@needs_library
class TestMerge:
    @settings(max_examples=60, deadline=None)
    @given(
        m=st.integers(1, 6),
        widths=st.lists(st.integers(1, 100), min_size=1, max_size=4),
        k=st.integers(1, 5),
        levels=st.integers(2, 50),
        reverse=st.booleans(),
        dtype=st.sampled_from([torch.float32, torch.float64]),
        seed=st.integers(0, 2**16),
    )
    def test_equals_the_torch_merge(self, m, widths, k, levels, reverse, dtype, seed):
        # few distinct values, so exact ties everywhere; tiles in either order, wide enough for
        # several of the kernel's chunks (32 floats, 16 doubles) and their tails
        from densematch.engine.merge import merge_best, merge_topk

        g = torch.Generator().manual_seed(seed)
        scores = torch.randint(0, levels, (m, sum(widths)), generator=g).to(dtype)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        tiles = list(zip(starts, widths, strict=True))[:: -1 if reverse else 1]
        kk = min(k, scores.shape[1])
        got_v, got_i = torch.full((m, kk), float("-inf"), dtype=dtype), torch.full((m, kk), -1)
        want_v, want_i = got_v.clone(), got_i.clone()
        for start, width in tiles:
            tile = scores[:, start : start + width]
            native.merge(tile, start, got_v, got_i)
            (merge_best if kk == 1 else merge_topk)(tile.contiguous(), start, want_v, want_i)
        if not reverse:  # the engine's order; torch's k=1 merge assumes it
            assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)
        # the definition, in any order: best scores first, equal scores by lowest column
        for r in range(m):
            order = sorted(range(scores.shape[1]), key=lambda c: (-scores[r, c].item(), c))[:kk]
            assert got_i[r].tolist() == order

    @settings(max_examples=40, deadline=None)
    @given(
        m=st.integers(1, 5),
        n=st.integers(1, 160),
        width=st.integers(1, 70),
        k=st.integers(1, 4),
        cap=st.integers(1, 12),
        slack=st.floats(0, 3),
        dtype=st.sampled_from([torch.float32, torch.float64]),
        seed=st.integers(0, 2**16),
    )
    def test_lists_every_pair_reaching_the_final_floor(self, m, n, width, k, cap, slack, dtype, seed):
        # each tile its own margin (the plain search's tile bounds): a pair is listed with its
        # score plus its tile's margin, and kept while that reaches the row's k-th best
        g = torch.Generator().manual_seed(seed)
        scores = torch.randn(m, n, generator=g, dtype=dtype)
        k = min(k, n)
        best_v, best_i = torch.full((m, k), float("-inf"), dtype=dtype), torch.full((m, k), -1)
        listed = native.Candidates(m, cap, dtype)
        upper = torch.empty_like(scores)
        for start in range(0, n, width):
            margin = slack * torch.rand(m, generator=g, dtype=dtype)
            native.merge(scores[:, start : start + width], start, best_v, best_i, margin, listed)
            upper[:, start : start + width] = scores[:, start : start + width] + margin[:, None]
        kth = best_v[:, -1]
        rows, cols = listed.reaching(kth)
        got = set(zip(rows.tolist(), cols.tolist(), strict=True))
        for r in range(m):
            want = {(r, c) for c in range(n) if upper[r, c] >= kth[r]}
            mine = {pair for pair in got if pair[0] == r}
            if listed.over[r]:
                assert not mine and len(want) > 0  # an over row is listed again by the caller
            else:
                assert mine == want and len(want) <= cap


@needs_library
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 7),
    c=st.integers(1, 40),
    with_u=st.booleans(),
    strided=st.booleans(),
    poisoned=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_row_norms_equal_float64_and_torchs(n, c, with_u, strided, poisoned, seed):
    # the bound terms' norms in one C pass (columns around its eight lanes and their tail, rows
    # of any stride, NaN and infinities) against float64 and against the torch form the engine
    # takes elsewhere: the same values to within an ulp of float32, non-finite where torch's are
    from densematch.precision import row_norms

    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, c + 3, generator=g) * 2.0 ** torch.randint(-20, 20, (n, 1), generator=g)
    x = wide[:, 1 : c + 1] if strided else wide[:, :c].contiguous()
    u = torch.randn(n, c, generator=g) if with_u else None
    h = (x + torch.randn(n, c, generator=g) * 1e-3 * x.abs()).to(torch.bfloat16)  # not always x rounded
    if poisoned and n * c:
        x.reshape(-1)[0] = math.nan if seed % 2 else math.inf
        h.view(-1)[-1] = -math.inf
    got, torch_form = native.row_norms(x, h, u), row_norms(x, h, u)
    h64 = h.double()
    diff = (h.float() - x).double()  # the difference in x's dtype, as both forms take it
    want = torch.stack(
        [
            x.double().norm(dim=1),
            h64.norm(dim=1),
            diff.norm(dim=1),
            u.double().norm(dim=1) if with_u else torch.zeros(n, dtype=torch.float64),
        ],
        dim=1,
    )
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and torch.equal(torch_form.isfinite(), finite)
    assert torch.equal(got.isnan(), want.isnan())
    close = dict(rtol=2.0**-22, atol=0.0)
    assert torch.allclose(got.double()[finite], want[finite], **close)
    assert torch.allclose(torch_form.double()[finite], want[finite], rtol=2.0**-20, atol=0.0)


@needs_library
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 100),
    c=st.integers(1, 40),
    extra=st.integers(0, 1),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_group_rows_are_the_torch_forms_of_their_own_centres(n, c, extra, strided, seed):
    # one C pass for the certified search's reference groups: the centres are the groups' means
    # (float64's, within float32's summation), and given those centres, the half rows are torch's
    # rounding of the rows less them, the norms native.row_norms' of them (the bound's terms), and
    # the body's norms float64's; a short last group, an extra (l2) column, strided rows
    from densematch.kernels.c_engine import GROUP

    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, c + extra + 2, generator=g) * 3 + torch.randn(1, c + extra + 2, generator=g) * 20
    r = wide[:, 1 : c + extra + 1] if strided else wide[:, : c + extra].contiguous()
    halves = torch.empty(n, c + extra, dtype=torch.bfloat16)
    centres, norms = native.group_rows(r, c, halves)
    body = r[:, :c]
    groups = -(-n // GROUP)
    owner = torch.arange(n) // GROUP
    want = torch.stack([body[owner == i].double().mean(0) for i in range(groups)])
    assert centres.shape == (groups, c)
    assert torch.allclose(centres.double(), want, rtol=0, atol=float(GROUP * 2.0**-23 * body.abs().max()))
    d = body - centres[owner]  # in float32, as the C pass and torch's _grouped make it
    assert torch.equal(halves[:, :c].view(torch.int16), d.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(halves[:, c:].view(torch.int16), r[:, c:].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(norms, native.row_norms(d, halves[:, :c].contiguous(), body))
    assert torch.allclose(norms[:, 3].double(), body.double().norm(dim=1), rtol=2.0**-22, atol=0)
    # a row that overflows its norm, or a NaN: no groups from C (torch's form takes the rows)
    r2 = r.clone()
    r2[n // 2, 0] = math.inf if seed % 2 else math.nan
    assert native.group_rows(r2, c, halves) is None


@needs_library
@settings(max_examples=100, deadline=None)
@given(
    m=st.integers(1, 9),
    n=st.integers(1, 200) | st.integers(260, 700),
    k=st.integers(1, 5) | st.integers(6, 20),
    cap=st.integers(1, 12) | st.integers(13, 80),
    with_bias=st.booleans(),
    with_groups=st.booleans(),
    poisoned=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_certified_merge_equals_its_torch_form(m, n, k, cap, with_bias, with_groups, poisoned, seed):
    # one C pass for the bounds, the merge of the lower bounds and the listing of the upper ones,
    # against the same steps in torch: the same top-k (ties to the lower column) and every pair
    # whose upper bound reaches the final floor listed, for the rows that never went over the cap
    # (a row over is skipped from then on: the engine searches it again in float32). Tiles of
    # several chunks starting inside a group (and of several of the chunk test's passes, with a
    # part pass after them), with the groups' additions, and NaN and infinities among the scores
    # and the reference terms: the chunk test (native.c) may skip only chunks where the pair loop
    # takes nothing
    from densematch.engine.merge import order

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, n, generator=g) * 4).round().to(torch.bfloat16)  # repeated values: ties
    # dyadic terms: every bound is exact in float32 whatever the summation order or FMA, so the
    # C pass and torch must agree exactly, ties included
    qt = torch.randint(0, 4, (m, 3), generator=g).float() * 2.0**-8
    rt = torch.randint(0, 4, (n, 3), generator=g).float() * 2.0**-8
    # each group's terms on a scale of its own (powers of two: still exact), so that a chunk's
    # largest terms tell it apart from the others' (the chunk test's share of each chunk)
    scales = 2.0 ** torch.randint(-3, 3, (n // native.GROUP + 1,), generator=g).float()
    rt *= scales[torch.arange(n) // native.GROUP, None]
    if poisoned:
        spots = torch.randint(0, m * n, (3,), generator=g)
        h.view(-1)[spots] = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.bfloat16)
        rt[int(torch.randint(0, n, (1,), generator=g)), 1] = math.nan
    bias = (torch.randn(n, generator=g) * 2).round() if with_bias else None
    rounding = 2.0**-9
    k = min(k, n)
    # each row's product with each group's centre and their bound's terms (native.GROUP columns a group)
    groups = n // native.GROUP + 1
    gp = torch.randn(m, groups, generator=g) * 8  # on the scores' scale: a group's addition decides
    gq, gt = torch.rand(m, 5, generator=g) * 1e-3, torch.rand(groups, 3, generator=g)
    best_v, best_i = torch.full((m, k), -math.inf), torch.full((m, k), -1, dtype=torch.int64)
    listed = native.Candidates(m, cap, torch.float32)
    half = n // 2
    for j, stop in ((0, half), (half, n)):  # two tiles
        if stop == j:
            continue
        first, last = j // native.GROUP, (stop - 1) // native.GROUP + 1
        tile_groups = (gp[:, first:last].contiguous(), gq, gt[first:last]) if with_groups else None
        tile_bias = None if bias is None else bias[j:stop]
        tile = h[:, j:stop]
        native.merge_certified(tile, j, best_v, best_i, qt, rt[j:stop], tile_bias, rounding, listed, tile_groups)
    hf = h.float()
    e = qt @ rt.T + rounding * hf.abs()
    low, up = hf - e, hf + e
    if bias is not None:
        low, up = low + bias, up + bias
    if with_groups:  # as native.c's group_slack forms each group's bound
        terms = (gq[:, :1] * gt[:, 0] + gq[:, 1:2] * gt[:, 1]) + gq[:, 2:3] * gt[:, 2]
        slack = (terms + gq[:, 3:4] * gp.abs()) + gq[:, 4:]
        column = torch.arange(n) // native.GROUP
        low, up = low + (gp - slack)[:, column], up + (gp + slack)[:, column]
    low, up = low.where(~low.isnan(), -math.inf), up.where(~up.isnan(), math.inf)
    want_v, want_i = order(low, torch.arange(n).expand(m, n).clone())
    want_i[want_v == -math.inf] = -1  # a lower bound of -inf (NaN's) never enters the top k
    kept = ~listed.over
    assert torch.equal(best_v[kept], want_v[kept, :k]) and torch.equal(best_i[kept], want_i[kept, :k])
    rows, cols = listed.reaching(best_v[:, -1])
    got = set(zip(rows.tolist(), cols.tolist(), strict=True))
    for r in range(m):
        if listed.over[r]:
            continue
        assert {(r, c) for c in range(n) if up[r, c] >= best_v[r, -1]} <= got


@needs_library
@pytest.mark.parametrize("with_groups", [False, True])
def test_a_certified_step_over_tiles_equals_one_call_a_tile(with_groups):
    # the engine's form: one CertifiedStep for a query tile's rows, the references' terms as planes
    # of the whole set sliced per tile (a row stride of the whole, not the tile), the bias a
    # strided column: the same top-k, lists and rows over as merge_certified called per tile
    g = torch.Generator().manual_seed(3)
    m, nb, k, cap = 9, 300, 3, 12
    h = (torch.randn(m, nb, generator=g) * 4).round().to(torch.bfloat16)
    qt = torch.randint(0, 4, (m, 3), generator=g).float() * 2.0**-8
    rt = torch.randint(0, 4, (nb, 3), generator=g).float() * 2.0**-8
    prepared = torch.randn(nb, 5, generator=g).round()  # the bias is its last column: stride 5
    groups = nb // native.GROUP + 1
    gp, gq = torch.randn(m, groups, generator=g) * 8, torch.rand(m, 5, generator=g) * 1e-3
    gt = torch.rand(groups, 3, generator=g)
    planes = rt.T.contiguous()
    results = []
    for stepwise in (False, True):
        best_v, best_i = torch.full((m, k), -math.inf), torch.full((m, k), -1, dtype=torch.int64)
        listed = native.Candidates(m, cap, torch.float32)
        step = native.CertifiedStep(best_v, best_i, qt, 2.0**-9, listed, gq if with_groups else None)
        for j in range(0, nb, 70):  # tiles that start inside a group
            stop = min(j + 70, nb)
            first, last = j // native.GROUP, (stop - 1) // native.GROUP + 1
            bias = prepared[j:stop, 4]
            if stepwise:
                pair = (gp[:, first:last], gt[first:last]) if with_groups else None
                step(h[:, j:stop], j, planes[:, j:stop], bias, pair)
            else:
                trio = (gp[:, first:last].contiguous(), gq, gt[first:last]) if with_groups else None
                native.merge_certified(h[:, j:stop], j, best_v, best_i, qt, rt[j:stop], bias, 2.0**-9, listed, trio)
        results.append((best_v, best_i, listed.over, *listed.reaching(best_v[:, -1])))
    assert all(torch.equal(x, y) for x, y in zip(*results, strict=True))
    assert results[0][3].numel() > 0  # pairs were listed
    best_v, best_i = torch.full((m, k), -math.inf), torch.full((m, k), -1, dtype=torch.int64)
    step = native.CertifiedStep(best_v, best_i, qt, 2.0**-9, native.Candidates(m, cap, torch.float32))
    with pytest.raises(ValueError, match="planes must be"):
        step(h[:, :32], 0, rt[:32])  # rows, not planes
    with pytest.raises(ValueError, match="group terms"):
        step(h[:, :32], 0, planes[:, :32], None, (gp[:, :1], gt[:1]))


@needs_library
@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 6),
    n=st.integers(1, 40),
    k=st.integers(1, 6),
    pairs=st.integers(0, 120),
    double=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_merged_pairs_equal_sorting_them(m, n, k, pairs, double, seed):
    # the C insertion of re-scored candidates, in any order, against the three stable sorts of
    # best_of_candidates: the same top-k, equal scores to the lower column, short rows left empty
    from densematch.engine.merge import best_of_candidates

    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    rows = torch.randint(0, m, (pairs,), generator=g)
    cols = torch.randint(0, n, (pairs,), generator=g)
    # each (row, column) scored once, as the search lists it; few distinct scores: ties
    first = {}
    for t, key in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
        first.setdefault(key, t)
    keep = torch.tensor(sorted(first.values()), dtype=torch.int64)
    rows, cols = rows[keep], cols[keep]
    score = torch.randint(-3, 4, (rows.numel(),), generator=g).to(dtype)
    want_v, want_i = torch.full((m, k), -math.inf, dtype=dtype), torch.full((m, k), -1, dtype=torch.int64)
    best_of_candidates(rows, cols, score, want_v, want_i)
    got_v, got_i = torch.full_like(want_v, -math.inf), torch.full_like(want_i, -1)
    native.merge_pairs(rows, cols, score, got_v, got_i)
    assert torch.equal(got_v, want_v) and torch.equal(got_i, want_i)


@needs_library
def test_merged_pairs_refuse_rows_outside_the_top_k():
    best_v, best_i = torch.full((2, 1), -math.inf), torch.full((2, 1), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="rows must index"):
        native.merge_pairs(torch.tensor([2]), torch.tensor([0]), torch.tensor([1.0]), best_v, best_i)
    with pytest.raises(ValueError, match="dtype"):
        wide = torch.tensor([1.0], dtype=torch.float64)
        native.merge_pairs(torch.tensor([0]), torch.tensor([0]), wide, best_v, best_i)


@needs_library
@settings(max_examples=40, deadline=None)
@given(
    c=st.integers(1, 40),
    double=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    special=st.sampled_from(["none", "zero", "nan", "tiny", "huge"]),
)
def test_cosine_with_reference_terms_gives_the_same_bits(c, double, seed, special):
    # the reference rows' scale and norm computed once (cosine_terms) against at every pair
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    q, r = torch.randn(9, c, generator=g, dtype=dtype), torch.randn(13, c, generator=g, dtype=dtype)
    scale = {"tiny": 1e-41 if not double else 1e-310, "huge": 1e36}.get(special)
    if special == "zero":
        r[2], q[1] = 0, 0
    elif special == "nan":
        r[2, -1], q[1, 0] = math.nan, math.nan
    elif scale is not None:
        r[2] *= scale
        q[1] *= scale
    idx = torch.randint(0, 13, (9, 5), generator=g)
    idx[:, 0] = 2  # every query meets the special reference
    want = native.pair_values(q, r, idx, "cosine")
    got = native.pair_values(q, r, idx, "cosine", r_terms=native.cosine_terms(r))
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="r_terms"):
        native.pair_values(q, r, idx, "dot", r_terms=native.cosine_terms(r))


@needs_library
@settings(max_examples=40, deadline=None)
@given(m=st.integers(0, 7), cap=st.integers(1, 9), double=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_listed_pairs_reaching_their_floor_as_a_mask_finds_them(m, cap, double, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    listed = native.Candidates(m, cap, dtype)
    listed.cols.copy_(torch.randint(0, 100, (m, cap), generator=g))
    listed.vals.copy_(torch.randint(-3, 4, (m, cap), generator=g).to(dtype))  # ties with the floor
    listed.counts.copy_(torch.randint(0, cap + 1, (m,), generator=g, dtype=torch.int32))
    listed.over.copy_(torch.rand(m, generator=g) < 0.3)
    floor = torch.randint(-3, 4, (m,), generator=g).to(dtype)
    if m:
        floor[0] = math.nan  # reaches nothing
    slot = torch.arange(cap)
    keep = (slot < listed.counts[:, None]) & (listed.vals >= floor[:, None]) & ~listed.over[:, None]
    want_rows, at = keep.nonzero().unbind(1)
    rows, cols = listed.reaching(floor)
    assert torch.equal(rows, want_rows) and torch.equal(cols, listed.cols[want_rows, at])


def _unaddressable(kind: str, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``like`` that C can take no pointer of: fake, meta or sparse."""
    if kind == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            return mode.from_tensor(like)
    if kind == "meta":
        return like.to("meta")
    return like.to_sparse()


@needs_library
@pytest.mark.parametrize("kind", ["fake", "meta", "sparse"])
def test_every_kind_of_wrapper_refuses_tensors_without_memory(kind):
    # each of these reached C unchecked once (fake tensors crashed the process); now every wrapper
    # takes its operands through one boundary, which names the rule
    x, y = torch.randn(3, 5), torch.randn(4, 3)
    best_v, best_i = torch.full((2, 1), -math.inf), torch.zeros((2, 1), dtype=torch.int64)
    calls = {
        "sqnorms": lambda bad: native.sqnorms(bad(x)),
        "minkowski": lambda bad: native.minkowski(bad(y), x, torch.empty(4, 5), linf=False),
        "minkowski_grad": lambda bad: native.minkowski_grad(y, x, bad(torch.ones(4, 5)), torch.ones(4, 5), linf=True),
        "cosine_terms": lambda bad: native.cosine_terms(bad(y)),
        "merge_pairs": lambda bad: native.merge_pairs(
            torch.tensor([0]), torch.tensor([0]), bad(torch.tensor([1.0])), best_v, best_i
        ),
        "align_best_shifts": lambda bad: native.align_best_shifts(bad(torch.randn(1, 2, 2, 3, 3)), 1),
    }
    for name, call in calls.items():
        with pytest.raises(
            ValueError, match=f"native.{name}'s tensor operand .* plain strided CPU tensor with storage"
        ):
            call(lambda t: _unaddressable(kind, t))
    assert float(native.sqnorms(x)[0]) == pytest.approx(float(x[:, 0].square().sum()))  # real ones still run


@needs_library
def test_wrappers_without_a_dtype_rule_have_one_now():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="float32 or float64"):
        native.sqnorms(x.half())
    with pytest.raises(ValueError, match="one float dtype"):
        native.minkowski_grad(torch.randn(4, 3).double(), x, torch.ones(4, 5), torch.ones(4, 5), linf=False)


def test_all_names_every_public_binding():
    # each module's __all__ names every public function and class it defines, and native, the
    # one name callers use, holds them all
    import inspect

    for module in (loader, c_engine, c_local, c_align):
        public = {
            name
            for name, v in vars(module).items()
            if not name.startswith("_")
            and (inspect.isfunction(v) or inspect.isclass(v))
            and v.__module__ == module.__name__
        }
        assert public <= set(module.__all__), (module.__name__, sorted(public - set(module.__all__)))
        assert set(module.__all__) <= set(native.__all__)
        assert all(getattr(native, name) is getattr(module, name) for name in module.__all__)


def test_the_header_is_the_one_signature_list():
    # every kernel the bindings call is declared in dm_abi.h, whose lines give ctypes its types
    # (each .c includes the header, so the compiler holds the definitions to the same lines)
    import re

    declared = native.signatures()
    header = native.HEADER.read_text()
    assert f"#define DM_ABI_VERSION {native.ABI_VERSION}\n" in header
    assert len(declared) == len(re.findall(r"^\w+\s+dm_\w+\(", header, flags=re.M)) > 30
    source = "".join(Path(m.__file__).read_text() for m in (c_engine, c_local, c_align))
    called = set(re.findall(r"lib\.(dm_\w+)", source))
    for stem in re.findall(r'f"(dm_\w+)_\{_SUFFIX', source):
        called |= {f"{stem}_f32", f"{stem}_f64"}
    assert called and called <= set(declared), sorted(called - set(declared))
    for src in native.SOURCES:
        assert '#include "dm_abi.h"' in src.read_text(), src.name
    lib = native.library()
    if lib is not None:
        for name, (args, result) in declared.items():
            fn = getattr(lib, name)
            assert (list(fn.argtypes), fn.restype) == (args, result), name


def test_the_type_templates_are_headers_included_once_per_type():
    # no kernel is a multi-line macro any more: each template header is plain C, included by its
    # source once for float and once for double, and part of the build cache's key
    import re

    from densematch.kernels import build

    for src in native.SOURCES:
        text = src.read_text()
        assert not re.search(r"^#define DEFINE_", text, flags=re.M), src.name
        for header in re.findall(r'^#include "(\w+_t\.h)"', text, flags=re.M):
            assert text.count(f'#include "{header}"') == 2, (src.name, header)
            assert re.findall(r"^#define SUF (\w+)", text, flags=re.M) == ["f32", "f64"], src.name
    names = {t.name for t in build.TEMPLATES}
    assert {"native_t.h", "align_t.h", "dm_template.h"} == names
    for template in build.TEMPLATES:
        assert not re.search(r"^#define DEFINE_", template.read_text(), flags=re.M), template.name


def test_a_header_type_without_a_ctypes_twin_is_refused():
    with pytest.raises(ValueError, match="no ctypes type for 'long double'"):
        loader._ctype("long double", "dm_example")


@needs_library
def test_a_library_of_another_abi_version_is_refused(monkeypatch):
    # a build of other declarations (a stale cache, another release's library) would be called
    # with the wrong arguments: it is not loaded, and torch's kernels run instead
    monkeypatch.setattr(loader, "ABI_VERSION", loader.ABI_VERSION + 1)
    monkeypatch.setattr(loader, "_status", {})
    with pytest.warns(RuntimeWarning, match=r"declares ABI version \d+, this package's bindings \d+"):
        assert native.library.__wrapped__() is None
    assert "ABI version" in loader._status["reason"]
