"""The batch runner: real-image pairs with known warps and bad pairs, both engines, resuming."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from densematch import warp
from densematch.app import batch
from densematch.app.batch import RESULTS, read_manifest

from .._reference import assert_same_up_to_ties, patch_features
from .test_cli import in_process

# (scale_h, scale_w, shift_y, shift_x) of each good align pair
WARPS = [(1.0, 1.0, 3.0, 5.0), (1.08, 0.94, 2.5, 4.25), (0.92, 1.05, 1.75, 0.5), (1.1, 1.1, 6.0, 2.0)]
SHIFT_TOL = 0.06  # pixels: the PNGs hold 8-bit grey levels


def write_manifest(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def records(folder: Path) -> dict[str, dict]:
    lines = (folder / RESULTS).read_text().splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def without_seconds(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (folder / RESULTS).read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """PNG pairs of scikit-image photographs: four good align pairs of one shape (batched), one
    of another shape, a missing template, a corrupt PNG and a template larger than its image;
    and match pairs of patch features."""
    from PIL import Image
    from skimage import data

    d = tmp_path_factory.mktemp("pairs")
    photos = [data.camera(), data.coins(), data.moon(), data.astronaut()[..., 1]]

    def grey(a, name):
        Image.fromarray((np.clip(a, 0, 1) * 255).round().astype(np.uint8)).save(d / name)

    rows = []
    for n, (photo, (sh, sw, sy, sx)) in enumerate(zip(photos, WARPS, strict=True)):
        img = torch.from_numpy(photo[::4, ::4][:72, :72].astype(np.float32) / 255)
        grey(img.numpy(), f"image{n}.png")
        grey(warp(img, sh, sw, sy, sx, (56, 56)).numpy(), f"template{n}.png")
        rows.append([f"pair{n}", f"template{n}.png", f"image{n}.png"])
    img = torch.from_numpy(data.camera()[::5, ::5][:80, :90].astype(np.float32) / 255)
    grey(img.numpy(), "image_wide.png")
    grey(warp(img, 1.0, 1.0, 4.0, 7.0, (60, 70)).numpy(), "template_wide.png")
    rows.append(["wide", "template_wide.png", "image_wide.png"])
    rows.append(["missing", "nowhere.png", "image0.png"])
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    rows.append(["corrupt", "corrupt.png", "image0.png"])
    rows.append(["too-large", "image0.png", "template0.png"])
    write_manifest(d / "align.csv", ["id", "template", "image"], rows)

    for n in range(6):
        cam = data.camera()[::8, ::8]
        np.save(d / f"fa{n}.npy", patch_features(cam[n : n + 24, n : n + 28]).numpy())
        np.save(d / f"fb{n}.npy", patch_features(cam[2 * n : 2 * n + 30, :30]).numpy())
    write_manifest(d / "match.csv", ["a", "b"], [[f"fa{n}.npy", f"fb{n}.npy"] for n in range(6)])
    return d


@pytest.fixture(scope="module")
def local_run(pairs, tmp_path_factory):
    """One local batch through the command, and its exit status and output."""
    out = tmp_path_factory.mktemp("local")
    code, stdout, stderr = in_process("batch", "align", str(pairs / "align.csv"), "-o", str(out))
    return out, code, stdout, stderr


def test_manifest_paths_ids_and_errors(pairs, tmp_path):
    got = read_manifest(pairs / "align.csv", "align")
    assert [p.id for p in got][:5] == ["pair0", "pair1", "pair2", "pair3", "wide"]
    assert got[0].inputs["template"] == str(pairs / "template0.png")
    numbered = read_manifest(pairs / "match.csv", "match")
    assert [p.id for p in numbered] == ["1", "2", "3", "4", "5", "6"]
    with pytest.raises(ValueError, match="missing image"):
        read_manifest(write_manifest(tmp_path / "m.csv", ["template"], [["a.png"]]), "align")
    with pytest.raises(ValueError, match="appears twice"):
        read_manifest(write_manifest(tmp_path / "m.csv", ["id", "a", "b"], [["x", "1", "2"], ["x", "3", "4"]]), "match")
    with pytest.raises(ValueError, match=r"id '\.\./x' must be"):
        read_manifest(write_manifest(tmp_path / "m.csv", ["id", "a", "b"], [["../x", "1", "2"]]), "match")
    with pytest.raises(ValueError, match="empty b"):
        read_manifest(write_manifest(tmp_path / "m.csv", ["a", "b"], [["1", ""]]), "match")
    with pytest.raises(ValueError, match="task must be one of"):
        read_manifest(pairs / "match.csv", "warp")


def test_local_results_equal_single_pair_commands(pairs, local_run):
    out, code, stdout, stderr = local_run
    assert code == 1, "a failed pair must make the exit status non-zero"
    assert "5 ok, 3 error, 0 skipped" in stdout
    got = records(out)
    assert list(got) == ["pair0", "pair1", "pair2", "pair3", "wide", "missing", "corrupt", "too-large"]
    for n, truth in enumerate(WARPS):
        r = got[f"pair{n}"]
        assert r["status"] == "ok" and r["error"] is None
        code, single, _ = in_process("align", str(pairs / f"template{n}.png"), str(pairs / f"image{n}.png"), "--json")
        assert code == 0
        single = json.loads(single)
        for key in ("scale_h", "scale_w", "shift_y", "shift_x"):
            assert r["result"][key] == pytest.approx(single[key], abs=1e-4), key
        found = [r["result"][key] for key in ("scale_h", "scale_w", "shift_y", "shift_x")]
        np.testing.assert_allclose(found, truth, atol=SHIFT_TOL)
    assert got["wide"]["result"]["shift_x"] == pytest.approx(7.0, abs=SHIFT_TOL)
    assert "does not exist" in got["missing"]["error"]
    assert "could not be read as an image" in got["corrupt"]["error"]
    assert "does not fit" in got["too-large"]["error"]
    for bad in ("missing", "corrupt", "too-large"):
        assert got[bad]["status"] == "error" and got[bad]["result"] is None
        assert f"densematch batch: {bad}: " in stderr


def test_second_run_skips_the_good_pairs_and_retries_the_errors(pairs, local_run, tmp_path):
    out, *_ = local_run
    copy = tmp_path / "again"
    copy.mkdir()
    (copy / RESULTS).write_text((out / RESULTS).read_text())
    code, stdout, _ = in_process("batch", "align", str(pairs / "align.csv"), "-o", str(copy), "--quiet")
    assert code == 1 and stdout == ""
    seen = []
    list(batch.run("align", read_manifest(pairs / "align.csv", "align"), out_dir=copy, on_skip=seen.append))
    assert [p.id for p in seen] == ["pair0", "pair1", "pair2", "pair3", "wide"]
    assert without_seconds(copy) == without_seconds(out)


def test_interrupted_results_resume_to_the_same_file(pairs, local_run, tmp_path):
    out, *_ = local_run
    lines = (out / RESULTS).read_text().splitlines(keepends=True)
    cut = tmp_path / "cut"
    cut.mkdir()
    # two records written, the third cut mid-line, as a killed run leaves it
    (cut / RESULTS).write_text(lines[0] + lines[3] + lines[1][: len(lines[1]) // 2])
    code, _, _ = in_process("batch", "align", str(pairs / "align.csv"), "-o", str(cut), "--quiet")
    assert code == 1
    assert without_seconds(cut) == without_seconds(out)


def test_killed_match_run_resumes(pairs, tmp_path):
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "densematch", "batch", "match", str(pairs / "match.csv"), "-o", str(out)]
    proc = subprocess.Popen([*command, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / RESULTS).exists() and (out / RESULTS).read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    written = (out / RESULTS).read_bytes().count(b"\n")
    assert 1 <= written < 6, f"the run was not stopped midway ({written} of 6 lines)"
    done = subprocess.run([*command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{6 - written} ok, 0 error, {written} skipped" in done.stdout
    got = records(out)
    assert list(got) == ["1", "2", "3", "4", "5", "6"] and all(r["status"] == "ok" for r in got.values())
    assert len((out / RESULTS).read_text().splitlines()) == 6
    # the same file as a run that never stopped (its figures up to float32 rounding)
    whole = tmp_path / "whole"
    assert in_process("batch", "match", str(pairs / "match.csv"), "-o", str(whole), "--quiet")[0] == 0
    for mine, theirs in zip(without_seconds(out), without_seconds(whole), strict=True):
        assert {k: v for k, v in mine.items() if k != "result"} == {k: v for k, v in theirs.items() if k != "result"}
        assert mine["result"].keys() == theirs["result"].keys()
        for key, value in mine["result"].items():
            assert value == (
                pytest.approx(theirs["result"][key], rel=1e-5) if isinstance(value, float) else theirs["result"][key]
            )
    # each output is the single command's answer (indices up to near-ties)
    for n, r in got.items():
        a, b = (np.load(pairs / f"f{s}{int(n) - 1}.npy") for s in "ab")
        saved = np.load(out / r["result"]["output"])
        one = tmp_path / f"one{n}.npz"
        assert (
            in_process(
                "match",
                str(pairs / f"fa{int(n) - 1}.npy"),
                str(pairs / f"fb{int(n) - 1}.npy"),
                "-o",
                str(one),
                "--quiet",
            )[0]
            == 0
        )
        single = np.load(one)
        ta, tb = torch.from_numpy(a).reshape(-1, a.shape[-1]), torch.from_numpy(b).reshape(-1, b.shape[-1])
        assert_same_up_to_ties(ta, tb, torch.from_numpy(saved["index"]), torch.from_numpy(single["index"]), "cosine")
        assert r["result"]["valid"] == pytest.approx(float(single["valid"].mean()))


def test_api_without_a_folder_returns_the_arrays(pairs):
    got = list(batch.run("match", [(pairs / "fa0.npy", pairs / "fb0.npy")], mutual=True))
    assert [r["status"] for r in got] == ["ok"]
    arrays = got[0]["arrays"]
    assert arrays["coords"].shape == (24, 28, 2) and arrays["valid"].dtype == bool
    assert got[0]["result"]["valid"] == pytest.approx(float(arrays["valid"].mean()))
    with pytest.raises(ValueError, match="viz=True needs out_dir"):
        list(batch.run("match", [], viz=True))
    with pytest.raises(ValueError, match="engine must be one of"):
        list(batch.run("match", [], engine="spark"))
    with pytest.raises(ValueError, match="workers must be an integer"):
        list(batch.run("match", [], workers=0))


def test_pictures_and_worker_processes(pairs, local_run, tmp_path):
    out, *_ = local_run
    two = tmp_path / "two"
    code, _, _ = in_process(
        "batch", "align", str(pairs / "align.csv"), "-o", str(two), "--workers", "2", "--viz", "--quiet"
    )
    assert code == 1
    mine, theirs = records(two), records(out)
    assert list(mine) == list(theirs)
    for key, r in mine.items():
        assert r["status"] == theirs[key]["status"] and r["error"] == theirs[key]["error"]
        if r["status"] == "ok":
            assert (two / r["result"]["picture"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            for field in ("scale_h", "scale_w", "shift_y", "shift_x"):
                assert r["result"][field] == pytest.approx(theirs[key]["result"][field], abs=1e-4)
    assert not list(two.glob(".*.tmp")), "a temporary file was left behind"


def test_command_errors_are_one_line(pairs, tmp_path):
    code, _, err = in_process("batch", "align", str(tmp_path / "none.csv"), "-o", str(tmp_path / "o"))
    assert code == 1 and err.count("\n") == 1 and "does not exist" in err
    (tmp_path / "file").write_text("")
    code, _, err = in_process("batch", "align", str(pairs / "align.csv"), "-o", str(tmp_path / "file"))
    assert code == 1 and "is a file" in err and err.count("\n") == 1
    code, _, err = in_process("batch", "match", str(pairs / "align.csv"), "-o", str(tmp_path / "o"))
    assert code == 1 and "missing a, b" in err


def test_ray_engine_matches_local(pairs, local_run, tmp_path):
    import ray

    out, *_ = local_run
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = tmp_path / "ray"
        code, _, _ = in_process(
            "batch", "align", str(pairs / "align.csv"), "-o", str(on_ray), "--engine", "ray", "--quiet"
        )
        assert code == 1
        mine, theirs = records(on_ray), records(out)
        assert list(mine) == list(theirs)
        for key, r in mine.items():
            assert (r["status"], r["error"]) == (theirs[key]["status"], theirs[key]["error"])
            if r["status"] == "ok":
                for field in ("scale_h", "scale_w", "shift_y", "shift_x"):
                    assert r["result"][field] == pytest.approx(theirs[key]["result"][field], abs=1e-4)
        matched = list(
            batch.run("match", read_manifest(pairs / "match.csv", "match"), engine="ray", out_dir=tmp_path / "m")
        )
        assert sorted(r["id"] for r in matched) == ["1", "2", "3", "4", "5", "6"]
        assert all(r["status"] == "ok" and (tmp_path / "m" / r["result"]["output"]).exists() for r in matched)
    finally:
        ray.shutdown()


# -- no lost records (issue 28) ----------------------------------------------------------------


def test_a_second_run_into_a_locked_folder_stops_naming_the_holder(pairs, tmp_path):
    from densematch.app.batch import LOCK

    out = tmp_path / "busy"
    first = batch.run("match", read_manifest(pairs / "match.csv", "match"), out_dir=out)
    next(first)  # the first run holds the folder while it works
    with pytest.raises(ValueError, match=rf"in use by another batch run \(pid {os.getpid()} on "):
        list(batch.run("match", read_manifest(pairs / "match.csv", "match"), out_dir=out))
    code, _, stderr = in_process("batch", "match", str(pairs / "match.csv"), "-o", str(out))
    assert code != 0 and "in use by another batch run" in stderr and len(stderr.strip().splitlines()) == 1
    rest = list(first)
    assert len(rest) == 5 and len(records(out)) == 6  # no record of the first run was lost
    assert len(list(batch.run("match", read_manifest(pairs / "match.csv", "match"), out_dir=out))) == 0
    assert (out / LOCK).exists()


def test_two_processes_into_one_folder_lose_no_record(pairs, tmp_path):
    # two manifests at once into one folder (the run that closed last used to rewrite the file
    # from what it had loaded, dropping the other's records): every record of a run that
    # finished stays; a run refused at start wrote nothing
    out = tmp_path / "both"
    halves = []
    for half, ids in (("first", range(3)), ("second", range(3, 6))):
        rows = [[f"{half}{n}", f"fa{n}.npy", f"fb{n}.npy"] for n in ids]
        halves.append(write_manifest(pairs / f"{half}.csv", ["id", "a", "b"], rows))
    command = [sys.executable, "-m", "densematch", "batch", "match"]
    procs = [
        subprocess.Popen([*command, str(m), "-o", str(out), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for m in halves
    ]
    codes = [p.wait(timeout=300) for p in procs]
    errors = [p.stderr.read().decode() for p in procs]
    assert sorted(codes) in ([0, 1], [0, 0]), errors
    want = set()
    for code, err, half in zip(codes, errors, ("first", "second"), strict=True):
        if code == 0:
            want |= {f"{half}{n}" for n in range(6) if f"{half}{n}" in (pairs / f"{half}.csv").read_text()}
        else:
            assert "in use by another batch run" in err
    assert set(records(out)) == want


def test_run_checks_ids_it_is_given(pairs, tmp_path):
    inputs = {"a": str(pairs / "fa0.npy"), "b": str(pairs / "fb0.npy")}
    for bad in ("../x", "/tmp/x", ""):
        with pytest.raises(ValueError, match="must be 1-128 letters"):
            list(batch.run("match", [batch.Pair(bad, inputs)], out_dir=tmp_path / "ids"))
    assert not (tmp_path / "x.npz").exists() and not Path("/tmp/x.npz").exists()


def test_ids_that_would_share_a_file_are_refused(pairs, tmp_path):
    # a pair called "index" lost its page to the batch's index.html
    inputs = {"a": str(pairs / "fa0.npy"), "b": str(pairs / "fb0.npy")}
    for reserved in ("index", "INDEX", "Index"):
        with pytest.raises(
            ValueError, match=f"id '{reserved}' is reserved: its page would be the batch's own index.html"
        ):
            list(batch.run("match", [batch.Pair(reserved, inputs)], out_dir=tmp_path / "r", html=True))
    assert not (tmp_path / "r" / "index.html").exists()
    # names that differ only in case are one file on macOS and Windows
    with pytest.raises(ValueError, match="id 'a' differs from id 'A' only in case"):
        read_manifest(write_manifest(tmp_path / "m.csv", ["id", "a", "b"], [["A", "1", "2"], ["a", "3", "4"]]), "match")
    with pytest.raises(ValueError, match="pairs: id 'x' appears twice"):
        list(batch.run("match", [batch.Pair("x", inputs), batch.Pair("x", inputs)]))
    assert read_manifest(write_manifest(tmp_path / "m.csv", ["id", "a", "b"], [["index2", "1", "2"]]), "match")


def test_a_manifest_not_in_utf8_is_named_with_the_fix(pairs, tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("a,b\nfa0.npy,caf\u00e9.npy\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.csv' is not UTF-8 text; save it as UTF-8"):
        read_manifest(path, "match")
    code, _, err = in_process("batch", "match", str(path), "-o", str(tmp_path / "o"))
    assert code == 1 and err.count("\n") == 1 and "is not UTF-8 text" in err and "Traceback" not in err


def test_bool_options_take_bools(pairs, tmp_path):
    inputs = {"a": str(pairs / "fa0.npy"), "b": str(pairs / "fb0.npy")}
    for name in ("viz", "html", "progress"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 'False'"):
            list(batch.run("match", [batch.Pair("x", inputs)], out_dir=tmp_path / "b", **{name: "False"}))


def test_manifest_with_a_byte_order_mark(pairs, tmp_path):
    path = tmp_path / "excel.csv"
    path.write_text("id,a,b\r\nfirst,fa0.npy,fb0.npy\r\n", encoding="utf-8-sig")
    (tmp_path / "fa0.npy").write_bytes((pairs / "fa0.npy").read_bytes())
    (tmp_path / "fb0.npy").write_bytes((pairs / "fb0.npy").read_bytes())
    assert [p.id for p in read_manifest(path, "match")] == ["first"]
    path.write_text("a,b\r\nfa0.npy,fb0.npy\r\n", encoding="utf-8-sig")
    assert read_manifest(path, "match")[0].inputs["a"] == str(tmp_path / "fa0.npy")


def test_a_complete_last_line_without_newline_is_kept(pairs, local_run, tmp_path):
    out, *_ = local_run
    lines = (out / RESULTS).read_text().splitlines()
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / RESULTS).write_text("\n".join(lines[:3]))  # a hand edit: no final newline
    seen = []
    list(batch.run("align", read_manifest(pairs / "align.csv", "align"), out_dir=edited, on_skip=seen.append))
    assert [p.id for p in seen] == ["pair0", "pair1", "pair2"]
    assert without_seconds(edited) == without_seconds(out)


def test_a_record_holding_nan_is_named_before_any_work(pairs, tmp_path):
    bad = tmp_path / "nan"
    bad.mkdir()
    record = {"id": "1", "inputs": {}, "status": "ok", "error": None, "result": {"mean": float("nan")}}
    clean = {**record, "id": "0", "result": {"mean": 1.0}}
    (bad / RESULTS).write_text(json.dumps(clean) + "\n" + json.dumps(record) + "\n")
    started = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{RESULTS} line 2 cannot be written back"):
        list(batch.run("match", read_manifest(pairs / "match.csv", "match"), out_dir=bad))
    assert time.perf_counter() - started < 60 and not list(bad.glob("*.npz"))
    code, _, stderr = in_process("batch", "match", str(pairs / "match.csv"), "-o", str(bad))
    assert code != 0 and "line 2" in stderr and len(stderr.strip().splitlines()) == 1
    # the lock was let go: a fixed file runs
    (bad / RESULTS).write_text(json.dumps(clean) + "\n")
    assert len(list(batch.run("match", read_manifest(pairs / "match.csv", "match"), out_dir=bad))) == 6
