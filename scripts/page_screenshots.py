"""Screenshots of the demo's pages for docs/images (view-match.png, view-align.png,
view-distance.png), taken in Debian's chromium through Playwright, with a pixel hovered.

Run: python scripts/page_screenshots.py [--out docs/images]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/images")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium: scripts/install-browser.sh installs Debian's")
    demo = Path(tempfile.mkdtemp()) / "demo"
    subprocess.run([sys.executable, "-m", "densematch", "demo", "--out", str(demo), "--quiet"], check=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 760})
        for name, canvas, where in (
            ("match", "#a", (0.45, 0.55)),
            ("align", None, None),
            ("distance", "#nearest", (0.3, 0.6)),
        ):
            page.goto((demo / f"{name}.html").as_uri())
            page.wait_for_selector("body[data-ready='1']")
            if canvas is not None:
                box = page.locator(canvas).bounding_box()
                page.mouse.move(box["x"] + where[1] * box["width"], box["y"] + where[0] * box["height"])
            page.screenshot(path=str(Path(args.out) / f"view-{name}.png"), full_page=True)
        browser.close()
    print(f"wrote {args.out}/view-match.png, view-align.png, view-distance.png")


if __name__ == "__main__":
    main()
