"""The real command, in a subprocess: help, each command on small real images, and each error."""

import argparse
import json
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from densematch import warp
from densematch.app.summary import summary_line

from .._reference import assert_same_up_to_ties


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "densematch.app.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image
    from skimage import data

    d = tmp_path_factory.mktemp("img")
    cam = data.camera()[::4, ::4].astype(np.float32) / 255  # 128 x 128
    img = torch.from_numpy(cam)
    Image.fromarray((cam[10:90, 20:100] * 255).astype(np.uint8)).save(d / "a.png")
    Image.fromarray((cam[4:100, 12:110] * 255).astype(np.uint8)).save(d / "b.png")
    big = img[:125, :125]
    tpl = warp(big, 1.06, 0.95, 5.5, 3.25, (100, 100))
    np.save(d / "template.npy", tpl.numpy())
    np.save(d / "image.npy", big.numpy())
    rng = np.random.default_rng(0)
    np.save(d / "fa.npy", rng.normal(size=(12, 14, 8)).astype(np.float32))
    np.save(d / "fb.npy", rng.normal(size=(10, 9, 8)).astype(np.float32))
    np.save(d / "fc.npy", rng.normal(size=(10, 9, 5)).astype(np.float32))
    np.save(d / "x.npy", rng.normal(size=(2, 8, 6, 7)).astype(np.float32))
    np.save(d / "p.npy", rng.normal(size=(5, 8)).astype(np.float32))
    return d


def in_process(*args: str) -> tuple[int, str, str]:
    """The command's exit status, stdout and stderr, run in this process (no torch start-up)."""
    import contextlib
    import io

    from densematch.app import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as stop:  # argparse's --help, --version and usage errors
            code = stop.code if isinstance(stop.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def test_help_and_version():
    code, out, _ = in_process("--help")
    assert code == 0 and all(c in out for c in ("match", "align", "distance", "demo", "bench"))
    for cmd in ("match", "align", "distance", "demo", "bench"):
        code, out, _ = in_process(cmd, "--help")
        assert code == 0 and "--quiet" in out
    assert "--mutual" in in_process("match", "--help")[1] and "--scale-h" in in_process("align", "--help")[1]
    v = run("--version")  # the real entry point, once
    assert v.returncode == 0 and v.stdout.startswith("densematch ")


def test_match_images_writes_npz_and_picture(images, tmp_path):
    out = run(
        "match",
        str(images / "a.png"),
        str(images / "b.png"),
        "--features",
        "patch",
        "--mutual",
        "-o",
        str(tmp_path / "m.npz"),
        "--viz",
        str(tmp_path / "m.png"),
    )
    assert out.returncode == 0, out.stderr
    z = np.load(tmp_path / "m.npz")
    assert z["coords"].shape == (80, 80, 2) and z["coords"].dtype == np.int64
    assert z["score"].dtype == np.float32 and z["valid"].dtype == bool
    # a is b shifted by (6, 8): mutual matches of textured pixels land there
    hit = (z["coords"][..., 0] == np.arange(80)[:, None] + 6) & (z["coords"][..., 1] == np.arange(80) + 8)
    assert hit[z["valid"]].mean() > 0.9
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_match_features_equal_the_library(images, tmp_path):
    import densematch

    out = run(
        "match",
        str(images / "fa.npy"),
        str(images / "fb.npy"),
        "--metric",
        "l2",
        "--k",
        "2",
        "--precision",
        "float32",
        "-o",
        str(tmp_path / "m.npz"),
        "--viz",
        str(tmp_path / "m.png"),
        "--quiet",
    )
    assert out.returncode == 0 and out.stdout == "" and (tmp_path / "m.png").stat().st_size > 10_000
    z = np.load(tmp_path / "m.npz")
    ref = densematch.match(
        np.load(images / "fa.npy"), np.load(images / "fb.npy"), metric="l2", k=2, precision="float32"
    )
    assert np.array_equal(z["index"], ref.index.numpy()) and z["coords"].shape == (12, 14, 2, 2)


def test_align_json_and_picture(images, tmp_path):
    out = run(
        "align", str(images / "template.npy"), str(images / "image.npy"), "--json", "--viz", str(tmp_path / "a.png")
    )
    assert out.returncode == 0, out.stderr
    ans = json.loads(out.stdout)
    assert set(ans) == {"scale_h", "scale_w", "shift_y", "shift_x", "error", "relative_error", "at_bound"}
    assert ans["at_bound"] == [] and ans["relative_error"] < 0.01 and "poor fit" not in out.stderr
    assert abs(ans["scale_h"] - 1.06) < 1e-3 and abs(ans["shift_x"] - 3.25) < 0.05
    assert (tmp_path / "a.png").exists()
    text = run("align", str(images / "template.npy"), str(images / "image.npy"), "--objective", "ncc")
    assert text.returncode == 0 and "scale_h 1.06" in text.stdout


def test_align_warns_of_a_poor_fit_and_suggests_ncc_where_brightness_differs(images, tmp_path):
    # a template whose brightness changed gave a wrong fit under l1 without a word
    tpl = np.load(images / "template.npy")
    np.save(tmp_path / "dim.npy", 0.4 * tpl + 0.5)
    code, out, err = in_process("align", str(tmp_path / "dim.npy"), str(images / "image.npy"), "--json")
    answer = json.loads(out)
    assert code == 0 and answer["relative_error"] > 0.5
    assert "a poor fit" in err and "try --objective ncc" in err  # beside the warning of a scale at its bound
    code, out, err = in_process("align", str(tmp_path / "dim.npy"), str(images / "image.npy"), "--objective", "ncc")
    assert code == 0 and "scale_h 1.06" in out and err == ""


def test_align_certify(images, tmp_path):
    # --certify proves the answer global (a translation, scales fixed: a second or so), says so
    # in a line or in the JSON, and names what it cannot take
    pair = (str(images / "template.npy"), str(images / "image.npy"))
    img = torch.from_numpy(np.load(images / "image.npy"))
    np.save(tmp_path / "t.npy", warp(img, 1.0, 1.0, 6.5, 3.25, (100, 100)).numpy())
    fixed = ("--scale-h", "1", "1", "--scale-w", "1", "1")
    code, out, err = in_process("align", str(tmp_path / "t.npy"), pair[1], *fixed, "--certify", "--json")
    assert code == 0, err
    c = json.loads(out)["certificate"]
    assert c["certified"] and c["reason"] == "" and c["within"] == [0.015, 0.015, 1.5, 1.5]
    code, out, err = in_process("align", str(tmp_path / "t.npy"), pair[1], *fixed, "--certify", "60")
    assert code == 0 and "certified: no better fit lies farther than 0.015 in scale or 1.5 px (" in out
    for extra, message in (
        (("--objective", "ncc"), "--certify needs --objective l1 or l2 (its bound is on differences), got ncc"),
        (("--mask", pair[0]), "--certify does not take --mask"),
        (("--certify", "0"), "--certify takes a positive number of seconds (or none), got 0.0"),
    ):
        code, out, err = in_process("align", *pair, "--certify", *extra)
        assert code != 0 and out == "" and message in err and err.count("\n") == 1


def test_distance_full_and_nearest(images, tmp_path):
    out = run("distance", str(images / "x.npy"), str(images / "p.npy"), "-o", str(tmp_path / "d.npy"))
    assert out.returncode == 0, out.stderr
    assert np.load(tmp_path / "d.npy").shape == (2, 5, 6, 7)
    out = run(
        "distance",
        str(images / "x.npy"),
        str(images / "p.npy"),
        "--nearest",
        "--metric",
        "l1",
        "-o",
        str(tmp_path / "n.npz"),
    )
    z = np.load(tmp_path / "n.npz")
    assert out.returncode == 0 and z["index"].shape == (2, 6, 7) and z["index"].max() < 5


def test_bench_prints_a_table_with_a_verdict_per_row():
    out = run("bench", "--quick", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    header, columns, *rows = out.stdout.splitlines()
    assert "match's exact default" in header and "threads" in header
    jobs = [r for r in rows if " ms " in r]
    assert len(jobs) == 9 and "verdict" in columns
    for name in ("match", "same scene", "torch.cdist", "local_match", "soft_match", "align", "coarse-to-fine grid"):
        assert any(name in r for r in jobs), name
    for r in jobs:
        said = re.search(r"\d\.\d\dx +\S+ +(.*)$", r).group(1)  # past the speed-up and the repeats' span
        assert said.split(":")[0] in ("ahead", "level", "level (noisy)", "behind"), r


@pytest.mark.parametrize(
    ("ours", "theirs", "said"),
    [
        ([1.0, 1.1, 1.2], [2.0, 2.1, 2.4], "ahead"),  # apart, and 1.75x
        ([2.0, 2.1, 2.4], [1.0, 1.1, 1.2], "behind"),
        # "behind 0.77x" then "ahead 1.96x": repeats that overlap call it level, whatever the median
        ([1.0, 1.3, 2.6], [0.9, 2.0, 2.7], "level (noisy)"),
        ([1.0, 1.02, 1.05], [1.0, 1.04, 1.07], "level"),
        ([1.0], [1.5], "ahead"),  # one repeat: no spread to overlap
    ],
)
def test_bench_calls_a_row_ahead_or_behind_only_where_the_repeats_do_not_overlap(ours, theirs, said):
    from densematch.app.bench import verdict

    got, ratio, (low, high) = verdict(ours, theirs)
    assert got == said and low <= ratio <= high


def test_every_bench_row_can_say_why_densematch_is_behind():
    # which rows come out behind depends on the machine and its load; that each could say why does not
    from densematch.app.bench import _jobs

    for quick in (True, False):
        assert all(len(job.why_behind) > 40 for job in _jobs(quick)), [j.name for j in _jobs(quick) if not j.why_behind]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("match", "missing.npy", "{d}/fb.npy"), "A 'missing.npy' does not exist"),
        (("match", "{d}/a.png", "{d}/b.png"), "is an image: pass --features"),
        (("match", "{d}/fa.npy", "{d}/fc.npy"), "no layout gives one channel count"),
        (("match", "{d}/fa.npy", "{d}/fc.npy", "--layout", "hwc"), "same number of channels, got 8 and 5"),
        (("match", "{d}/fa.npy", "{d}/fb.npy", "--k", "0"), "k must be >= 1, got 0"),
        (("match", "{d}/fa.npy", "{d}/fb.npy", "--metric", "l3"), "invalid choice: 'l3'"),
        (("match", "{d}/fa.npy", "{d}/fb.npy", "--precision", "half"), "invalid choice: 'half'"),
        (("match", "{d}/p.npy", "{d}/fb.npy"), "must hold one feature map, (H, W, C) or (C, H, W)"),
        (("match", "{d}/fa.npy", "{d}/bad.npy"), "could not be read as an array"),
        (("match", "{d}/fa.npy", "{d}/zip.npy"), "it is a zip archive (.npz?)"),
        (("match", "{d}/fa.npy", "{d}/huge.npy"), "header declares shape (20000, 20000, 64)"),
        (("align", "{d}/image.npy", "{d}/template.npy"), "does not fit in the image"),
        (("distance", "{d}/x.npy", "{d}/fb.npy"), "prototypes must have shape"),
        (("distance", "{d}/x.npy", "{d}/p.npy", "--metric", "cos"), "invalid choice: 'cos'"),
    ],
)
def test_errors_are_one_line_without_traceback(images, args, pattern, tmp_path):
    (images / "bad.npy").write_bytes(b"not an array")
    np.savez(images / "zip.npz", features=np.zeros((3, 3, 8), np.float32))
    (images / "zip.npz").replace(images / "zip.npy")
    # a valid header declaring 95 GiB, and no data: refused before any allocation
    with open(images / "huge.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (20000, 20000, 64)})
    code, _, err = in_process(
        *(a.format(d=images) for a in args),
        "-o" if args[0] == "match" else "--quiet",
        *([str(tmp_path / "never.npz")] if args[0] == "match" else []),
    )
    assert code != 0
    assert pattern in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "never.npz").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_the_real_command_reports_an_error_in_one_line(images):
    out = run("match", str(images / "fa.npy"), str(images / "fc.npy"), "--layout", "hwc")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "densematch match: error: A and B must have the same number of channels, got 8 and 5 "
        "(feature files read as hwc; --layout chooses)"
    )


def test_failed_write_leaves_no_file(images, tmp_path, monkeypatch):
    from densematch.app import io

    target = tmp_path / "out.npz"

    def explode(f, **arrays):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(io.np, "savez", explode)
    with pytest.raises(OSError, match="disk full"):
        io.save_npz(target, a=np.zeros(3))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flag", "where", "pattern"),
    [
        ("-o", "no/such/folder/m.npz", "the folder"),
        ("-o", "", "is a folder; give a file name"),
        ("--viz", "missing/m.png", "the folder"),
    ],
)
def test_outputs_are_checked_before_the_work(images, tmp_path, monkeypatch, capsys, flag, where, pattern):
    from densematch.app import cli
    from densematch.matching import dense as _match

    called = []
    monkeypatch.setattr(_match.engine, "topk", lambda *a, **k: called.append(1))
    code = cli.main(["match", str(images / "fa.npy"), str(images / "fb.npy"), flag, str(tmp_path / where), "--quiet"])
    assert code == 1 and called == []
    err = capsys.readouterr().err
    assert pattern in err and flag in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_write_leaves_no_file(images, tmp_path, sig):
    # the command is stopped while it writes its output: no output, no hidden temporary file
    # a parent that ignores SIGINT (a shell's background job) passes that on, and Python then
    # installs no KeyboardInterrupt handler: the child takes Python's default back
    script = f"""
import signal, sys, time
import numpy as np
from densematch.app import cli, io
signal.signal(signal.SIGINT, signal.default_int_handler)
def slow(f, **arrays):
    f.write(b"partial")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
io.np.savez = slow
sys.exit(cli.main(["match", "{images}/fa.npy", "{images}/fb.npy", "-o", "{tmp_path}/m.npz", "--quiet"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the write is under way
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (128 + sig, 130), err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_output_keeps_the_umask_without_setting_it(images, tmp_path):
    import os

    from densematch.app import io

    calls = []
    real = os.umask
    old = real(0o027)
    try:
        os.umask = lambda mask: calls.append(mask) or real(mask)
        io.save_npy(tmp_path / "x.npy", np.zeros(3))
    finally:
        os.umask = real
        real(old)
    assert calls == []  # never touched: a race with other threads creating files
    assert (tmp_path / "x.npy").stat().st_mode & 0o777 == 0o640


def test_debug_shows_the_traceback(images):
    out = run("match", "missing.npy", str(images / "fb.npy"), "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr


class Opaque:
    """Something torch.load(weights_only=True) refuses to unpickle."""


def test_every_option_has_help_and_its_default():
    from densematch.app.cli import _Help, build_parser

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    for parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest in ("help", "version"):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help"
            if action.option_strings and action.default not in (None, False):
                text = _Help(parser.prog)._get_help_string(action)
                assert "default" in text, f"{parser.prog} {action.option_strings} shows no default"


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("match", "{d}/fa.npy", "{d}/fb.npy", "-o", "{t}/m.txt"), "-o '{t}/m.txt': the extension chooses the format"),
        (("match", "{d}/fa.npy", "{d}/fb.npy", "--viz", "{t}/m.gif"), "use one of .png, .jpg, .jpeg, .pdf, .svg"),
        (("distance", "{d}/x.npy", "{d}/p.npy", "--k", "3"), "--k and --precision apply only with --nearest"),
        (("match", "{d}/pickled.pt", "{d}/fb.npy"), "holds pickled Python objects, not one tensor"),
        (("match", "{d}/two.npz", "{d}/fb.npy"), "holds 2 arrays (features, other): name one"),
        (("match", "{d}/two.npz:nope", "{d}/fb.npy"), "has no array 'nope'; it holds features, other"),
        (("align", "{d}/image.npy", "{d}/template.npy"), "were template and image swapped?"),
    ],
)
def test_outputs_and_inputs_obey_their_names(images, tmp_path, args, pattern):
    import pickle

    with open(images / "pickled.pt", "wb") as fh:
        pickle.dump({"weights": Opaque()}, fh, protocol=4)
    np.savez(images / "two.npz", features=np.zeros((3, 3, 8), np.float32), other=np.zeros(2))
    code, _, err = in_process(*(a.format(d=images, t=tmp_path) for a in args))
    assert code == 1 and pattern.format(t=tmp_path) in err, err
    assert len(err.strip().splitlines()) == 1 and "\x1b" not in err
    assert list(tmp_path.iterdir()) == []


def test_output_formats_follow_the_extension(images, tmp_path):
    code, _, _ = in_process("match", str(images / "fa.npy"), str(images / "fb.npy"), "-o", str(tmp_path / "c.npy"))
    assert code == 0 and np.load(tmp_path / "c.npy").shape == (12, 14, 2)
    np.savez(tmp_path / "in.npz", features=np.load(images / "fa.npy"), other=np.zeros(2))
    code, _, _ = in_process(
        "match", f"{tmp_path}/in.npz:features", str(images / "fb.npy"), "-o", str(tmp_path / "all.npz"), "--quiet"
    )
    assert code == 0
    # the same matches (up to near-ties), as flat indices of B's 10 x 9 grid
    fa, fb = (torch.from_numpy(np.load(images / f)).reshape(-1, 8) for f in ("fa.npy", "fb.npy"))
    flat = [
        torch.from_numpy(c[..., 0] * 9 + c[..., 1])
        for c in (np.load(tmp_path / "all.npz")["coords"], np.load(tmp_path / "c.npy"))
    ]
    assert_same_up_to_ties(fa, fb, *flat, "cosine")
    for suffix, magic in ((".jpg", b"\xff\xd8\xff"), (".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")):
        path = tmp_path / f"m{suffix}"
        code, _, err = in_process("match", str(images / "fa.npy"), str(images / "fb.npy"), "--viz", str(path))
        assert code == 0, err
        assert path.read_bytes().startswith(magic), suffix
    code, _, _ = in_process(
        "distance", str(images / "x.npy"), str(images / "p.npy"), "--nearest", "--k", "2", "-o", str(tmp_path / "i.npy")
    )
    assert code == 0 and np.load(tmp_path / "i.npy").shape == (2, 2, 6, 7)


def test_options_that_change_nothing_say_so(images):
    code, _, err = in_process("match", str(images / "fa.npy"), str(images / "fb.npy"), "--features", "patch")
    assert code == 0 and err.strip() == (
        "densematch match: warning: --features is ignored: A and B are feature files, not images"
    )


def test_align_at_the_edge_of_its_range_warns(images, tmp_path):
    img = torch.from_numpy(np.load(images / "image.npy"))
    np.save(tmp_path / "t.npy", warp(img, 1.3, 1.0, 20.0, 4.0, (80, 80)).numpy())
    code, out, err = in_process("align", str(tmp_path / "t.npy"), str(images / "image.npy"), "--json")
    assert code == 0 and json.loads(out)["at_bound"] == ["scale_h"]
    assert err.count("\n") == 1 and "warning: the best scale_h lies at an end of the range" in err
    assert "--scale-h" in err
    code, out, err = in_process(
        "align", str(tmp_path / "t.npy"), str(images / "image.npy"), "--json", "--scale-h", "1.1", "1.5"
    )
    assert code == 0 and json.loads(out)["at_bound"] == [] and err == ""
    assert json.loads(out)["scale_h"] == pytest.approx(1.3, abs=0.01)


def test_full_distances_stream_within_the_budget(images, tmp_path):
    # 2 x 90 x 150 x 160 float32 distances (17 MiB) written in slices under a 4 MiB budget
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.normal(size=(2, 8, 150, 160)).astype(np.float32))
    np.save(tmp_path / "p.npy", rng.normal(size=(90, 8)).astype(np.float32))
    from densematch.app import tasks

    calls = []
    real = tasks.pairwise_distance
    tasks.pairwise_distance = lambda x, p, *a, **k: calls.append(p.shape[0]) or real(x, p, *a, **k)
    try:
        code, _, err = in_process(
            "distance",
            str(tmp_path / "x.npy"),
            str(tmp_path / "p.npy"),
            "-o",
            str(tmp_path / "d.npy"),
            "--memory",
            "4MiB",
        )
    finally:
        tasks.pairwise_distance = real
    assert code == 0, err
    assert max(calls) * 150 * 160 * 4 <= 2 * 2**20 and sum(calls) == 2 * 90
    want = densematch_distance(tmp_path / "x.npy", tmp_path / "p.npy")
    np.testing.assert_allclose(np.load(tmp_path / "d.npy"), want, rtol=1e-5, atol=1e-5)


def densematch_distance(x, p):
    import densematch

    return densematch.pairwise_distance(
        torch.from_numpy(np.load(x)).double(), torch.from_numpy(np.load(p)).double()
    ).numpy()


def test_info_says_what_runs():
    from densematch import __version__

    code, out, _ = in_process("info")
    lines = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()}
    assert code == 0 and lines["densematch"] == __version__
    assert lines["kernels"] in ("in use", "off (DENSEMATCH_NATIVE=0)") or lines["kernels"].startswith("unavailable")
    assert "cpu features" in lines and 'precision="exact" on the CPU' in lines


def test_feature_files_in_chw_with_a_batch_of_one_and_masks(images, tmp_path):
    import densematch

    fa, fb = np.load(images / "fa.npy"), np.load(images / "fb.npy")
    torch.save(torch.from_numpy(fa).permute(2, 0, 1)[None].clone(), tmp_path / "a.pt")  # a network's (1, C, H, W)
    np.save(tmp_path / "b.npy", np.ascontiguousarray(fb.transpose(2, 0, 1)))  # (C, H, W)
    mask_b = np.zeros(fb.shape[:2], np.uint8)
    mask_b[2:9, 3:11] = 255
    np.save(tmp_path / "mask_b.npy", mask_b)
    # read as (H, W, C) they would hold 14 and 9 channels: only (C, H, W) fits, so no flag is needed
    code, _, err = in_process("match", str(tmp_path / "a.pt"), str(tmp_path / "b.npy"), "-o", str(tmp_path / "x.npz"))
    assert code == 0 and err == ""
    code, _, err = in_process(
        "match", str(tmp_path / "a.pt"), str(tmp_path / "b.npy"), "--layout", "chw",
        "--mask-b", str(tmp_path / "mask_b.npy"), "-o", str(tmp_path / "m.npz"), "--quiet",
    )  # fmt: skip
    assert code == 0, err
    want = densematch.match(fa, fb, mask_b=mask_b > 0)
    z = np.load(tmp_path / "m.npz")
    assert np.array_equal(z["index"], want.index.numpy())
    assert np.array_equal(np.load(tmp_path / "x.npz")["index"], densematch.match(fa, fb).index.numpy())
    rows, cols = z["index"] // fb.shape[1], z["index"] % fb.shape[1]
    assert mask_b[rows, cols].all()
    code, _, err = in_process(
        "match", str(images / "fa.npy"), str(images / "fb.npy"), "--mask-a", str(tmp_path / "mask_b.npy")
    )
    assert code == 1 and "--mask-a" in err and "must have its map's size" in err


def test_demo_creates_its_folder_but_not_missing_parents_unless_asked(tmp_path, monkeypatch):
    # `densematch demo --out /some/absolute/path` made that whole tree at the file system's root
    target = tmp_path / "missing" / "deeper"
    code, _, err = in_process("demo", "--out", str(target))
    assert code == 1 and err.count("\n") == 1 and "does not exist; create it, or pass --parents" in err
    assert not (tmp_path / "missing").exists()
    from densematch.app import demo

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after the folder")

    monkeypatch.setattr(demo, "_sample", stop)  # the folder is all this test needs
    code, _, err = in_process("demo", "--out", str(target), "--parents")
    assert code == 1 and "stopped after the folder" in err and target.is_dir()


def _page_data(path) -> dict:
    text = path.read_text()
    return json.loads(text.split('<script type="application/json" id="data">', 1)[1].split("</script>", 1)[0])


def test_one_summary_gives_every_output_its_figures(images, tmp_path):
    # issue 42: the command said 24.5% valid, the picture 72% and 76% invalid, the page 71.5%;
    # now each reads one summary, counted over A's pixels by their best candidate
    from PIL import Image

    from densematch.app.tasks import match_pair

    mask = np.ones((80, 80), np.uint8) * 255
    mask[:, :10] = 0  # a strip of A masked out: its own reason
    Image.fromarray(mask).save(tmp_path / "mask.png")
    args = [str(images / "a.png"), str(images / "b.png"), "--features", "patch", "--k", "3", "--mutual"]
    args += ["--mask-a", str(tmp_path / "mask.png")]
    code, out, _ = in_process("match", *args, "--json", "--html", str(tmp_path / "m.html"))
    assert code == 0
    summary = json.loads(out)["summary"]
    assert summary["counts"] == "pixels of A, by their best candidate" and summary["pixels"] == 6400
    invalid = summary["invalid"]
    assert invalid["masked"] == 800 and set(invalid) == {"masked", "no candidate", "mutual"}
    assert summary["valid"] + sum(invalid.values()) == summary["pixels"]
    line = summary_line(summary)
    assert f"{summary['valid_fraction']:.1%}" in line and "candidates" in line
    code, out, _ = in_process("match", *args)
    assert code == 0 and line in out
    assert line in _page_data(tmp_path / "m.html")["notes"][0]["text"]
    # the picture: its title and its caption, from the same summary
    r = match_pair(args[0], args[1], features="patch", k=3, mutual=True, mask_a=args[-1], viz=True)
    texts = [ax.get_title() for ax in r.figure.axes] + [t.get_text() for t in r.figure.texts]
    assert any(f"({summary['valid_fraction']:.0%} valid)" in t for t in texts)
    caption = next(t for t in texts if "invalid (black)" in t)
    assert caption.startswith(f"{1 - summary['valid_fraction']:.0%} of A's pixels invalid")
    assert "masked out in A" in caption and "mutual check" in caption and "ratio" not in caption


def test_the_summary_splits_two_filters_by_their_own_verdicts(images):
    # with mutual and ratio both on, each invalid pixel is counted under each filter it fails,
    # from the reverse pass and the ratio of its best two, searched here independently
    import densematch
    from densematch.app.features import dense_features
    from densematch.app.io import load_image
    from densematch.metrics import get_metric

    code, out, _ = in_process("match", str(images / "a.png"), str(images / "b.png"), "--features", "patch",
                              "--mutual", "--ratio", "0.9", "--json")  # fmt: skip
    assert code == 0
    summary = json.loads(out)["summary"]
    fa, fb = (dense_features(load_image(images / n, grey=True), "patch") for n in ("a.png", "b.png"))
    best = densematch.match(fa, fb)
    back = densematch.match(fb, fa).index.reshape(-1)
    here = torch.arange(best.index.numel()).reshape(best.index.shape)
    fails_mutual = back[best.index] != here
    d = get_metric("cosine").ratio_distance(densematch.match(fa, fb, k=2).score)  # what Lowe's test compares
    fails_ratio = ~(d[..., 0] <= 0.9 * d[..., 1])
    assert summary["invalid"]["mutual"] == int(fails_mutual.sum())
    assert summary["invalid"]["ratio"] == int(fails_ratio.sum())
    assert summary["valid"] == int((~fails_mutual & ~fails_ratio).sum())


def test_a_layout_is_never_misread_silently(tmp_path):
    # issue 42: a (C, H, W) pair of equal shapes was read as (H, W, C) with exit 0; now the default
    # warns, naming both readings, --layout auto refuses, and a mask or a channel count that
    # fits one reading alone settles it
    import densematch

    rng = np.random.default_rng(1)
    a, b = (rng.normal(size=(6, 20, 20)).astype(np.float32) for _ in range(2))  # (C, H, W)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    pair = (str(tmp_path / "a.npy"), str(tmp_path / "b.npy"))
    code, _, err = in_process("match", *pair)
    assert code == 0 and err.count("\n") == 1 and "warning: read as (H, W, C), where both layouts fit" in err
    assert "a 6x20 map of 20 channels, or as (C, H, W), a 20x20 map of 6" in err and "--layout hwc or chw" in err
    code, _, err = in_process("match", *pair, "--layout", "auto")
    assert code == 1 and err.count("\n") == 1 and "--layout auto cannot tell" in err
    mask = np.ones((20, 20), np.uint8)
    np.save(tmp_path / "mask.npy", mask)
    code, _, err = in_process("match", *pair, "--layout", "auto", "--mask-a", str(tmp_path / "mask.npy"),
                              "-o", str(tmp_path / "m.npz"))  # fmt: skip
    assert code == 0 and err == ""  # a 20x20 mask: only (C, H, W) gives A that grid
    # the library reads the (C, H, W) maps in place, the command a channels-last copy: another
    # summation order, so near-ties may go either way
    want = densematch.match(a, b, layout="chw")
    rows_a, rows_b = (torch.from_numpy(x.reshape(6, -1).T.copy()) for x in (a, b))
    got = torch.from_numpy(np.load(tmp_path / "m.npz")["index"])
    assert_same_up_to_ties(rows_a, rows_b, got, want.index, "cosine")
    # distance reads by the prototypes' depth: (H, W, D) and (D, H, W) files give one answer
    p = rng.normal(size=(4, 6)).astype(np.float32)
    np.save(tmp_path / "p.npy", p)
    np.save(tmp_path / "hwc.npy", np.ascontiguousarray(a[:, :, :15].transpose(1, 2, 0)))  # (20, 15, 6)
    np.save(tmp_path / "chw.npy", a[:, :, :15])
    for name in ("hwc", "chw"):
        code, _, err = in_process("distance", str(tmp_path / f"{name}.npy"), str(tmp_path / "p.npy"),
                                  "-o", str(tmp_path / f"d-{name}.npy"))  # fmt: skip
        assert code == 0 and err == "", err
    assert np.array_equal(np.load(tmp_path / "d-hwc.npy"), np.load(tmp_path / "d-chw.npy"))
    code, _, err = in_process("distance", str(tmp_path / "hwc.npy"), str(tmp_path / "p.npy"), "--layout", "chw")
    assert (code == 1 and "channels" in err.lower()) or "6" in err
