"""The HTML pages (densematch.app.view), opened in a real browser: Debian's chromium, driven by
Playwright by its path, offline. Everything a test checks is read back from the page."""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from densematch import align, shift_landscape, warp
from densematch.app.cli import main

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


@pytest.fixture
def run(capsys):
    """The command line in this process (the tests' time is the pages', not torch's start-up):
    its exit code, what it printed and what it said on stderr."""

    def go(*args: str) -> SimpleNamespace:
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return go


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (scripts/install-browser.sh installs Debian's as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def browser_or_none(request):
    """open_page where a browser exists, else None (for tests whose other half needs none)."""
    if CHROMIUM is None:
        return None
    return request.getfixturevalue("open_page")


@pytest.fixture
def open_page(browser):
    """Open a page offline; the page, and what it logged as errors or tried to fetch."""
    opened = []

    def go(path: Path):
        context = browser.new_context(offline=True, viewport={"width": 1400, "height": 900})
        page = context.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("request", lambda r: None if r.url.startswith(("data:", "file:")) else problems.append(r.url))
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        opened.append(context)
        return page, problems

    yield go
    for context in opened:
        context.close()


def hover(page, canvas: str, row: int, col: int, h: int, w: int) -> None:
    """The mouse over the centre of a map's pixel (row, col), inside the canvas' border."""
    x, y = page.evaluate(
        f"""() => {{ const c = document.querySelector('{canvas}'), r = c.getBoundingClientRect();
        return [r.left + c.clientLeft + ({col} + 0.5) * c.clientWidth / {w},
                r.top + c.clientTop + ({row} + 0.5) * c.clientHeight / {h}]; }}"""
    )
    page.mouse.move(x, y)


def pixels(page, canvas: str) -> int:
    """A checksum of the canvas' pixels, read in the page."""
    return page.evaluate(
        f"""() => {{ const c = document.querySelector('{canvas}');
        return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)
          .reduce((s, v, i) => (s + v * (i % 251 + 1)) % 1000000007, 0); }}"""
    )


@pytest.fixture(scope="module")
def shifted_photos(tmp_path_factory):
    """Two crops of one photograph: A's pixel (r, c) is B's (r - 6, c + 8)."""
    from PIL import Image
    from skimage import color, data

    d = tmp_path_factory.mktemp("photos")
    img = color.rgb2gray(data.astronaut())[::4, ::4]
    for name, crop in (("a", img[10:74, 20:84]), ("b", img[16:96, 12:92])):
        Image.fromarray((crop * 255).round().astype(np.uint8)).save(d / f"{name}.png")
    return d


def test_the_demo_writes_pictures_and_pages_that_open(tmp_path, capsys, browser_or_none):
    from densematch.app.demo import run_demo

    assert run_demo(tmp_path / "demo") == 0
    out = capsys.readouterr().out
    assert "align:" in out and "match:" in out and "distance:" in out
    for name in ("match.png", "align.png", "distance.png", "match.html", "align.html", "distance.html"):
        assert (tmp_path / "demo" / name).stat().st_size > 10_000
    for name in ("match.html", "align.html", "distance.html"):  # and says where the pages are
        assert str(tmp_path / "demo" / name) in out
    if browser_or_none is None:
        pytest.skip("the demo's pages were written; no chromium here to open them")
    for name, canvas, (h, w) in (
        ("match", "#a", (96, 96)),
        ("align", "#blend", (100, 100)),
        ("distance", "#nearest", (151, 192)),
    ):
        page, problems = browser_or_none(tmp_path / "demo" / f"{name}.html")
        hover(page, canvas, h // 2, w // 2, h, w)
        if name != "align":
            assert page.locator("#candidates tr.candidate").count() >= 1
        assert problems == [], name


def test_match_page_marks_the_known_position_and_lists_the_npz_candidates(shifted_photos, open_page, run):
    d = shifted_photos
    out = run("match", f"{d}/a.png", f"{d}/b.png", "--features", "patch", "--k", "3", "--mutual", "--ratio", "0.9",
              "-o", f"{d}/m.npz", "--html", f"{d}/m.html")  # fmt: skip
    assert out.returncode == 0, out.stderr
    saved = np.load(d / "m.npz")
    page, problems = open_page(d / "m.html")
    for r, c in ((30, 30), (12, 45), (50, 10)):
        hover(page, "#a", r, c, 64, 64)
        mark = page.locator("#b-mark")
        assert (float(mark.get_attribute("data-row")), float(mark.get_attribute("data-col"))) == (r - 6, c + 8)
        cells = page.locator("#candidates tr.candidate").all()
        assert len(cells) == 3
        listed = [int(row.locator("td").nth(2).inner_text()) for row in cells]
        scores = [float(row.locator("td").nth(3).inner_text()) for row in cells]
        assert listed == saved["index"][r, c].tolist()
        assert scores == pytest.approx(saved["score"][r, c].tolist(), abs=1e-4)
        assert page.locator("#a-pixel").inner_text().startswith(f"A pixel ({r}, {c})")
        checks = page.locator("#checks").inner_text()
        assert "mutual" in checks and "ratio" in checks
    # a click pins the pixel: moving on changes nothing until the next click
    hover(page, "#a", 30, 30, 64, 64)
    page.mouse.down()
    page.mouse.up()
    hover(page, "#a", 40, 40, 64, 64)
    assert page.locator("#a-pixel").inner_text().startswith("A pixel (30, 30) (pinned")
    # the keyboard reaches A: focus, then arrows move the cursor
    page.locator("#a").click()  # unpin
    page.locator("#a").focus()
    page.keyboard.press("ArrowRight")
    first = page.locator("#a-pixel").inner_text()
    page.keyboard.press("ArrowDown")
    assert page.locator("#a-pixel").inner_text() != first
    # toggles redraw A: the pull-back of B onto A's grid
    before = pixels(page, "#a")
    page.locator("#toggle-pullback").check()
    page.wait_for_selector("body[data-layers*='pullback']")  # the redraw is asynchronous (images decode)
    assert pixels(page, "#a") != before
    # from B's side: the reverse pass (mutual) names B's best in A
    hover(page, "#b", 24, 38, 80, 80)
    assert page.locator("#reverse").inner_text().endswith("(30, 30)")
    assert problems == []


def map_point(page, canvas: str, row: float, col: float) -> tuple[float, float]:
    """Where the centre of map pixel (row, col) is on the screen, under the canvas' zoom and pan."""
    return page.evaluate(
        f"""() => {{ const v = window.densematch.views['{canvas}'], c = v.canvas, r = c.getBoundingClientRect();
        const [x, y] = v.at({row}, {col});
        return [r.left + c.clientLeft + x * c.clientWidth / c.width,
                r.top + c.clientTop + y * c.clientHeight / c.height]; }}"""
    )


@pytest.fixture
def match_page_open(shifted_photos, open_page, run):
    d = shifted_photos
    out = run("match", f"{d}/a.png", f"{d}/b.png", "--features", "patch", "--k", "3", "-o", f"{d}/z.npz",
              "--html", f"{d}/z.html")  # fmt: skip
    assert out.returncode == 0, out.stderr
    page, problems = open_page(d / "z.html")
    return page, problems, np.load(d / "z.npz")


def test_match_page_zooms_and_pans_with_crisp_pixels_and_one_state(match_page_open):
    page, problems, saved = match_page_open
    state = "() => ({...window.densematch.state, zoom: window.densematch.views.a.scale})"
    page.mouse.move(*map_point(page, "a", 30, 30))
    for _ in range(4):
        page.mouse.wheel(0, -100)
    page.wait_for_function("() => window.densematch.views.a.scale > 2")
    # zoomed about the pointer: the pixel under it stays under it
    page.mouse.move(*map_point(page, "a", 30, 30))
    assert page.evaluate(state)["pixel"] == [30, 30]
    for r, c in ((28, 33), (31, 27)):  # other pixels, at the zoomed positions
        page.mouse.move(*map_point(page, "a", r, c))
        assert page.locator("#a-pixel").inner_text().startswith(f"A pixel ({r}, {c})")
        listed = [int(row.locator("td").nth(2).inner_text()) for row in page.locator("#candidates tr.candidate").all()]
        assert listed == saved["index"][r, c].tolist()
    # crisp: every canvas pixel inside one map pixel (away from its grid lines and marks) is one colour
    cell = page.evaluate(
        """() => { const v = window.densematch.views.a, [x, y] = v.at(24, 36), h = v.cell / 2 - 2;
        const d = v.ctx.getImageData(Math.ceil(x - h), Math.ceil(y - h), Math.floor(2 * h), Math.floor(2 * h)).data;
        const seen = new Set(); for (let i = 0; i < d.length; i += 4) seen.add(d.slice(i, i + 3).join());
        return [seen.size, v.cell]; }"""
    )
    assert cell[1] >= 16 and cell[0] == 1
    # a drag pans, and the click that ends it pins nothing
    before = page.evaluate("() => [window.densematch.views.a.oy, window.densematch.views.a.ox]")
    x, y = map_point(page, "a", 30, 30)
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x - 80, y - 40, steps=4)
    page.mouse.up()
    after = page.evaluate("() => [window.densematch.views.a.oy, window.densematch.views.a.ox]")
    assert after[0] > before[0] and after[1] > before[1]
    assert page.evaluate(state)["pinned"] is False
    # the keys: 0 zooms back, + in again; arrows move the cursor, and the cursor survives a toggle
    page.mouse.move(*map_point(page, "a", 5, 5))
    page.locator("#a").focus()
    page.keyboard.press("0")
    assert page.evaluate(state)["zoom"] == 1
    page.keyboard.press("+")
    assert page.evaluate(state)["zoom"] > 1
    page.keyboard.press("ArrowRight")
    moved = page.evaluate(state)["pixel"]
    page.locator("#toggle-pullback").check()  # the pointer leaves A for the box: the keys' pixel stays
    page.wait_for_selector("body[data-layers*='pullback']")
    assert page.evaluate(state)["pixel"] == moved
    assert page.locator("#a-pixel").inner_text().startswith(f"A pixel ({moved[0]}, {moved[1]})")
    # a toggle's redraw, finishing while the pointer is over B, draws B's pixel, not A's last one
    page.mouse.move(*map_point(page, "b", 24, 38))
    page.evaluate(
        "() => { const box = document.getElementById('toggle-pullback'); box.checked = false;"
        " box.dispatchEvent(new Event('change')); }"
    )
    page.wait_for_function(
        "() => document.body.dataset.pixel === 'b:24,38' && !document.body.dataset.layers.includes('pullback')"
    )
    assert page.locator("#b-pixel").inner_text() == "B pixel (24, 38)" and page.locator("#a-pixel").count() == 0
    assert problems == []


def test_match_page_draws_the_best_candidate_on_top_and_lenses_show_pixels(match_page_open):
    page, problems, saved = match_page_open
    coords = saved["coords"]
    # a pixel whose second candidate touches its best: the rings overlap
    gap = np.abs(coords[:, :, 1] - coords[:, :, 0]).max(-1)
    r, c = map(int, np.argwhere((gap <= 1) & (saved["index"][..., 1] >= 0))[0])
    page.mouse.move(*map_point(page, "a", r, c))
    by, bx = coords[r, c, 0].tolist()
    ring = page.evaluate(
        f"""() => {{ const v = window.densematch.views.b, [x, y] = v.at({by}, {bx}), s = v.ring() + 1, out = [];
        for (let t = 0; t < 48; t++) {{
          const a = 2 * Math.PI * t / 48;
          const px = Math.round(x + s * Math.cos(a) - 0.5), py = Math.round(y + s * Math.sin(a) - 0.5);
          out.push(Array.from(v.ctx.getImageData(px, py, 1, 1).data.slice(0, 3)));
        }}
        return out; }}"""
    )
    magenta = [p for p in ring if abs(p[0] - 224) < 40 and p[1] < 70 and abs(p[2] - 127) < 50]
    yellow = [p for p in ring if p[0] > 150 and p[1] > 150 and p[2] < 150]  # the other candidates' rings
    assert len(magenta) >= 24 and yellow == [], ring  # the best's ring whole: the others drawn under it
    # the lenses: the pictures' own pixels, magnified, with no ring or label in them
    for lens, side, (y, x) in (("lens-a", "a", (r, c)), ("lens-b", "b", (int(by), int(bx)))):
        diff = page.evaluate(
            f"""() => {{ const v = window.densematch.views['{side}'], lens = document.getElementById('{lens}');
            const want = document.createElement('canvas'); want.width = lens.width; want.height = lens.height;
            const w = want.getContext('2d'); w.imageSmoothingEnabled = false; w.fillStyle = '#fff';
            w.fillRect(0, 0, want.width, want.height);
            w.drawImage(v.plain, {x} - 6, {y} - 6, 13, 13, 0, 0, want.width, want.height);
            const a = lens.getContext('2d').getImageData(0, 0, lens.width, lens.height).data;
            const b = w.getImageData(0, 0, want.width, want.height).data, cell = lens.width / 13;
            let bad = 0;
            for (let i = 0; i < a.length; i += 4) {{
              const px = (i / 4) % lens.width, py = Math.floor(i / 4 / lens.width);
              const inSquare = Math.abs(px - 6.5 * cell) < cell / 2 + 3 && Math.abs(py - 6.5 * cell) < cell / 2 + 3;
              if (!inSquare && (a[i] !== b[i] || a[i + 1] !== b[i + 1] || a[i + 2] !== b[i + 2])) bad++;
            }}
            return bad; }}"""
        )
        assert diff == 0, (lens, diff)
    assert problems == []


def test_align_page_blend_slider_shift_panel_and_readouts(tmp_path, open_page, run):
    from PIL import Image
    from skimage import data

    img = (data.camera()[::4, ::4][:125, :125] / 255.0).astype(np.float32)
    tpl = warp(torch.from_numpy(img), 1.07, 0.93, 7.3, 4.6, (100, 100)).numpy()
    # noise, so that the warped image and the template differ and the blend shows it
    tpl = tpl + 0.05 * np.random.default_rng(0).standard_normal(tpl.shape).astype(np.float32)
    np.save(tmp_path / "t.npy", tpl)
    Image.fromarray((img * 255).round().astype(np.uint8)).save(tmp_path / "i.png")
    out = run("align", str(tmp_path / "t.npy"), str(tmp_path / "i.png"), "--html", str(tmp_path / "a.html"))
    assert out.returncode == 0, out.stderr
    page, problems = open_page(tmp_path / "a.html")
    before = pixels(page, "#blend")
    slide = (
        "v => { const s = document.getElementById('blend-slider'); s.value = v; s.dispatchEvent(new Event('input')) }"
    )
    # polled by a function the page runs: the page's policy forbids evaluating strings
    settled = "async v => { while (document.body.dataset.blend !== v) await new Promise(r => setTimeout(r, 10)) }"
    page.evaluate(slide, "100")
    page.evaluate(settled, "100")
    after = pixels(page, "#blend")
    page.evaluate(slide, "0")
    page.evaluate(settled, "0")
    assert len({before, after, pixels(page, "#blend")}) == 3
    params = dict(line.split("\t") for line in page.locator("#params").inner_text().splitlines()[1:])
    assert float(params["scale_h"]) == pytest.approx(1.07, abs=0.005)
    # the landscape tells each scale pair's best shift; the shift panel, the error at every shift
    # at the answer's scales, with ticks in shift
    a = align(tpl, img)
    n_h, n_w = a.landscape.shape[1:]
    for r, c in ((0, 0), (n_h // 2, n_w // 3)):
        hover(page, "#landscape", r, c, n_h, n_w)
        y, x = (int(v) for v in a.landscape_shifts[0, r, c])
        assert page.locator("#landscape-value").inner_text().endswith(f", best shift ({y}, {x})")
    around = shift_landscape(tpl, img, a.scale_h, a.scale_w).numpy()
    n_y, n_x = around.shape
    assert (n_y, n_x) == (math.floor(125 * a.scale_h) - 100 + 1, math.floor(125 * a.scale_w) - 100 + 1)
    shift_ticks = page.locator("#shifts").locator("xpath=..").locator(".col-tick").all_inner_texts()
    assert [float(t) for t in shift_ticks][:: len(shift_ticks) - 1] == [0, n_x - 1]
    for r, c in ((0, 0), (7, 4), (n_y - 1, n_x - 1)):
        hover(page, "#shifts", r, c, n_y, n_x)
        said = page.locator("#shifts-value").inner_text()
        head, value = said.split(": error ")
        assert head == f"shift_y {r}, shift_x {c}"
        assert float(value) == pytest.approx(float(around[r, c]), rel=1e-3, abs=1e-6)
    low = np.unravel_index(around.argmin(), around.shape)
    assert abs(low[0] - a.shift_y) < 1 and abs(low[1] - a.shift_x) < 1
    assert problems == []


def test_align_landscape_has_scale_ticks_and_a_hover_readout(tmp_path, open_page):
    from densematch.app.view import align_page, write_page

    g = np.random.default_rng(0)
    sh, sw = np.linspace(0.8, 1.25, 10), np.geomspace(0.7, 1.4, 13)
    land = g.random((10, 13)).astype(np.float32)
    tpl = g.random((30, 40)).astype(np.float32)
    answer = {"scale_h": float(sh[3]), "scale_w": float(sw[8]), "shift_y": 1.5, "shift_x": 2.0, "error": 0.01}
    write_page(tmp_path / "a.html", align_page(tpl, tpl, land, sh, sw, answer, "l1"))
    page, problems = open_page(tmp_path / "a.html")
    rows = [float(t) for t in page.locator(".row-tick").all_inner_texts()]
    cols = [float(t) for t in page.locator(".col-tick").all_inner_texts()]
    assert rows[0] == pytest.approx(0.8, abs=1e-3) and rows[-1] == pytest.approx(1.25, abs=1e-3) and len(rows) == 5
    assert cols[0] == pytest.approx(0.7, abs=1e-3) and cols[-1] == pytest.approx(1.4, abs=1e-3) and len(cols) == 5
    assert set(rows) <= {round(v, 3) for v in sh} and set(cols) <= {round(v, 3) for v in sw}
    # each tick sits beside its cell: tick j's centre over column j's centre
    centre = page.evaluate(
        """() => { const t = document.querySelectorAll('.col-tick'), c = document.querySelector('#landscape');
        const r = t[t.length - 1].getBoundingClientRect(), b = c.getBoundingClientRect();
        return [(r.left + r.right) / 2 - b.left - c.clientLeft, c.clientWidth / 13]; }"""
    )
    assert centre[0] == pytest.approx(12.5 * centre[1], abs=2)
    for r, c in ((0, 0), (7, 5), (9, 12)):
        hover(page, "#landscape", r, c, 10, 13)
        said = page.locator("#landscape-value").inner_text()
        assert said == f"scale_h {sh[r]:.4f}, scale_w {sw[c]:.4f}: error {land[r, c]:.6f}"
    assert problems == []


def test_distance_page_lists_each_pixel_s_nearest_prototypes(tmp_path, open_page, run):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 20, 24, generator=g)
    protos = x[0, :, ::5, ::6].reshape(6, -1).T.contiguous()  # 16 prototypes, pixels of the map
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "p.npy", protos.numpy())
    out = run("distance", str(tmp_path / "x.npy"), str(tmp_path / "p.npy"), "--nearest", "--k", "3",
              "-o", str(tmp_path / "d.npz"), "--html", str(tmp_path / "d.html"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    saved = np.load(tmp_path / "d.npz")
    page, problems = open_page(tmp_path / "d.html")
    assert page.locator("#legend > span").count() == 16
    for r, c in ((5, 6), (13, 2)):
        hover(page, "#nearest", r, c, 20, 24)
        rows = page.locator("#candidates tr.candidate").all()
        listed = [int(row.locator("td").nth(1).inner_text().split()[-1]) for row in rows]
        assert listed == saved["index"][0, :, r, c].tolist()
    assert problems == []


def heat_colour(page, r: int, c: int) -> list[int]:
    """The heat map's colour at the centre of map pixel (r, c), read from its canvas."""
    return page.evaluate(
        f"""() => {{ const c = document.querySelector('#heat'), z = c.width / 24;
        return Array.from(c.getContext('2d').getImageData(Math.floor(({c} + 0.5) * z),
          Math.floor(({r} + 0.5) * z), 1, 1).data.slice(0, 3)); }}"""
    )


def test_distance_page_heat_maps_the_nearest_and_each_chosen_prototype(tmp_path, open_page, run):
    from matplotlib import colormaps

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 20, 24, generator=g)
    protos = x[0, :, ::5, ::6].reshape(6, -1).T.contiguous()  # prototype 4 * i + j is pixel (5 i, 6 j)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "p.npy", protos.numpy())
    out = run("distance", str(tmp_path / "x.npy"), str(tmp_path / "p.npy"), "--html", str(tmp_path / "d.html"))
    assert out.returncode == 0, out.stderr
    full = torch.cdist(x[0].flatten(1).T.double(), protos.double()).T.reshape(16, 20, 24).numpy()
    nearest = full.min(0)
    lo, hi = 0.0, float(full.max())  # the pixels of the prototypes are at 0 from them
    page, problems = open_page(tmp_path / "d.html")
    assert page.locator("#heat-choice option").count() == 17  # the nearest, then each prototype

    def expect(values: np.ndarray, r: int, c: int) -> list[int]:
        level = int(np.clip(round((values[r, c] - lo) / (hi - lo) * 255), 0, 255))
        return list(colormaps["viridis"](level, bytes=True)[:3])

    def near(got: list[int], want: list[int]) -> bool:  # a level either side: float32 against float64
        return max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 12

    for r, c in ((3, 4), (11, 17)):
        assert near(heat_colour(page, r, c), expect(nearest, r, c))
    before = pixels(page, "#heat")
    page.select_option("#heat-choice", "9")  # prototype 9: pixel (10, 6)
    page.wait_for_selector("body[data-heat='9']")
    assert pixels(page, "#heat") != before
    for r, c in ((10, 6), (3, 4), (11, 17)):
        assert near(heat_colour(page, r, c), expect(full[9], r, c))
    hover(page, "#heat", 10, 6, 20, 24)
    said = page.locator("#heat-value").inner_text()
    assert said.startswith("heat map, distance to prototype 9: ") and float(said.split(": ")[1]) == pytest.approx(
        0, abs=1e-3
    )
    hover(page, "#heat", 19, 0, 20, 24)  # far from prototype 9 (pixel (10, 6)): not among its 3 nearest
    said = page.locator("#heat-value").inner_text()
    value = float(said.split(": ")[1].split()[0])
    assert "heat map level, within" in said and abs(value - full[9, 19, 0]) <= (hi - lo) / 255
    bar = page.locator("figure:has(#heat) .barlabels span").all_inner_texts()
    assert float(bar[0]) == pytest.approx(lo, abs=1e-3) and float(bar[2]) == pytest.approx(hi, abs=1e-3)
    assert problems == []


def test_batch_index_links_every_pair_and_shows_errors(tmp_path, open_page, run):
    g = np.random.default_rng(0)
    image = g.random((40, 40)).astype(np.float32)
    np.save(tmp_path / "image.npy", image)
    np.save(tmp_path / "t1.npy", warp(image, 1.0, 1.0, 3.0, 2.0, (30, 30)).numpy())
    (tmp_path / "pairs.csv").write_text("template,image,id\nt1.npy,image.npy,one\nmissing.npy,image.npy,two\n")
    out = run("batch", "align", str(tmp_path / "pairs.csv"), "-o", str(tmp_path / "out"), "--html", "--viz")
    assert out.returncode == 1  # one pair failed
    page, problems = open_page(tmp_path / "out" / "index.html")
    rows = page.locator("#pairs tr.pair")
    assert rows.count() == 2
    assert "ok" in rows.nth(0).inner_text() and "error" in rows.nth(1).inner_text()
    assert "missing.npy" in rows.nth(1).inner_text()
    link = rows.nth(0).locator("a").get_attribute("href")
    assert link == "one.html" and (tmp_path / "out" / link).exists()
    assert rows.nth(0).locator("img.thumb").count() == 1
    # view draws the same index from the folder, elsewhere, with links that still resolve
    (tmp_path / "pages").mkdir()
    assert run("view", str(tmp_path / "out"), "-o", str(tmp_path / "pages" / "i.html")).returncode == 0
    again, _ = open_page(tmp_path / "pages" / "i.html")
    assert again.locator("#pairs a").first.get_attribute("href") == "../out/one.html"
    assert problems == []


def test_a_pair_at_a_bound_is_flagged_in_its_row_not_on_the_terminal(tmp_path, open_page, run, capsys):
    # the index read "ok" for a pair whose scale lay at the end of the range searched, and the
    # warning went to the terminal as a raw Python warning
    g = np.random.default_rng(2)
    image = g.random((60, 60)).astype(np.float32)
    np.save(tmp_path / "image.npy", image)
    np.save(tmp_path / "near.npy", warp(image, 1.0, 1.0, 3.0, 2.0, (40, 40)).numpy())
    np.save(tmp_path / "far.npy", warp(image, 1.3, 1.0, 3.0, 2.0, (40, 40)).numpy())  # past scale_h's 1.2
    (tmp_path / "pairs.csv").write_text("template,image,id\nnear.npy,image.npy,near\nfar.npy,image.npy,far\n")
    out = run("batch", "align", str(tmp_path / "pairs.csv"), "-o", str(tmp_path / "out"), "--html")
    assert out.returncode == 0 and "Warning" not in out.stderr and "at an end" not in out.stderr
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert "warning" not in records["near"]
    assert records["far"]["status"] == "ok" and "scale_h at an end of the range searched" in records["far"]["warning"]
    assert "--scale-h" in records["far"]["warning"]
    page, problems = open_page(tmp_path / "out" / "index.html")
    rows = page.locator("#pairs tr.pair")
    assert rows.nth(0).locator("td.ok").inner_text() == "ok"
    assert rows.nth(1).locator("td.warn").inner_text().startswith("ok, but scale_h at an end")
    assert "(1 with a warning)" in page.inner_text("body") and problems == []


def test_names_holding_script_markup_leave_every_page_drawn(tmp_path, open_page, run):
    # "<!--" and "<script" in a name kept the data's script element open to the end of the
    # page: every page kind came up blank, the batch index too
    folder = tmp_path / "<!--<script>x"
    folder.mkdir()
    g = np.random.default_rng(1)
    image = g.random((40, 40)).astype(np.float32)
    np.save(folder / "image.npy", image)
    np.save(folder / "t1.npy", warp(image, 1.0, 1.0, 3.0, 2.0, (30, 30)).numpy())
    (folder / "pairs.csv").write_text("template,image,id\nt1.npy,image.npy,one\n<!--<script>.npy,image.npy,two\n")
    out = run("batch", "align", str(folder / "pairs.csv"), "-o", str(tmp_path / "out"), "--html")
    assert out.returncode == 1  # the second pair's file does not exist
    index, problems = open_page(tmp_path / "out" / "index.html")
    rows = index.locator("#pairs tr.pair")
    assert rows.count() == 2 and "<!--<script>.npy" in rows.nth(1).inner_text()
    # the pages whose titles hold the inputs' names: match's and distance's
    fa, fb = g.standard_normal((12, 14, 4)).astype(np.float32), g.standard_normal((10, 12, 4)).astype(np.float32)
    np.save(folder / "fa.npy", fa)
    np.save(folder / "fb.npy", fb)
    np.save(folder / "x.npy", fa.transpose(2, 0, 1)[None])
    np.save(folder / "p.npy", fb.reshape(-1, 4)[:5])
    for command in (
        ("match", str(folder / "fa.npy"), str(folder / "fb.npy"), "--html", str(tmp_path / "m.html")),
        ("distance", str(folder / "x.npy"), str(folder / "p.npy"), "--nearest", "--html", str(tmp_path / "d.html")),
    ):
        assert run(*command).returncode == 0
        page, more = open_page(tmp_path / command[-1].rsplit("/", 1)[-1])
        assert "<!--<script>x" in page.title() and pixels(page, "canvas") != 0
        problems += more
    assert problems == []


def test_view_draws_a_saved_match_again_and_refuses_a_changed_one(shifted_photos, tmp_path, open_page, run):
    d = shifted_photos
    assert run("match", f"{d}/a.png", f"{d}/b.png", "--features", "patch", "-o", f"{tmp_path}/m.npz").returncode == 0
    out = run("view", f"{tmp_path}/m.npz", "-o", f"{tmp_path}/m.html")
    assert out.returncode == 0, out.stderr
    page, problems = open_page(tmp_path / "m.html")
    hover(page, "#a", 30, 30, 64, 64)
    assert float(page.locator("#b-mark").get_attribute("data-row")) == 24
    assert problems == []
    # the recorded run no longer gives the saved arrays: said in one line, no page written
    with np.load(tmp_path / "m.npz") as z:
        arrays = {name: z[name] for name in z.files}
    arrays["index"] = arrays["index"][::-1].copy()
    np.savez(tmp_path / "m2.npz", **arrays)
    out = run("view", f"{tmp_path}/m2.npz", "-o", f"{tmp_path}/m2.html")
    assert out.returncode == 1 and "changed since" in out.stderr and not (tmp_path / "m2.html").exists()
    assert "Traceback" not in out.stderr


def test_a_256x256_match_with_k_4_stays_under_5_mb(tmp_path, run):
    # bounded size without a browser: the arrays travel whole, so the page grows with h w k
    g = torch.Generator().manual_seed(0)
    fa, fb = torch.randn(256, 256, 8, generator=g), torch.randn(256, 256, 8, generator=g)
    np.save(tmp_path / "a.npy", fa.numpy())
    np.save(tmp_path / "b.npy", fb.numpy())
    out = run("match", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--k", "4", "--html", str(tmp_path / "p.html"))
    assert out.returncode == 0, out.stderr
    size = (tmp_path / "p.html").stat().st_size
    assert size <= 5 * 2**20, f"{size / 2**20:.2f} MiB"
    text = (tmp_path / "p.html").read_text()
    data = json.loads(text.split('<script type="application/json" id="data">', 1)[1].split("</script>", 1)[0])
    assert data["arrays"]["index"]["shape"] == [256, 256, 4] and "http" not in text.replace("http-equiv", "")


def test_pages_need_no_browser_to_be_written_and_bad_outputs_say_so(tmp_path, run):
    out = run("match", "x.npy", "y.npy", "--html", str(tmp_path / "page.txt"))
    assert out.returncode != 0 and "--html" in out.stderr and "extension" in out.stderr
    out = run("view", str(tmp_path), "-o", str(tmp_path / "v.html"))
    assert out.returncode == 1 and "results.jsonl" in out.stderr and "Traceback" not in out.stderr
