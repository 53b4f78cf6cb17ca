"""Run Kornia's own matcher tests with densematch.kornia in place of kornia.feature.matching.

Usage: python scripts/run-kornia-tests.py KORNIA_CHECKOUT [--dtype all] [--original]

KORNIA_CHECKOUT is a clone of github.com/kornia/kornia (its tests are not copied here). The
script copies its conftest.py, testing/ and tests/feature/test_matching.py into a temporary
folder, adds one import line after the file's imports so that match_nn, match_mnn, match_snn,
match_smnn, match_fginn and DescriptorMatcher are densematch's, and runs the test classes of
those functions (TestMatchNN to TestMatchFGINN). --original runs them unchanged, against Kornia.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OURS = "from densematch.kornia import DescriptorMatcher, match_fginn, match_mnn, match_nn, match_smnn, match_snn\n"
CLASSES = "TestMatchNN or TestMatchMNN or TestMatchSNN or TestMatchSMNN or TestMatchFGINN"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kornia", type=Path)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--original", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copy(args.kornia / "conftest.py", root)
        shutil.copytree(args.kornia / "testing", root / "testing")
        (root / "tests" / "feature").mkdir(parents=True)
        text = (args.kornia / "tests" / "feature" / "test_matching.py").read_text()
        if not args.original:
            anchor = "from testing.casts import dict_to\n"
            if anchor not in text:
                raise SystemExit(f"the test file no longer has the line {anchor.strip()!r}: update this script")
            text = text.replace(anchor, anchor + OURS)
        (root / "tests" / "feature" / "test_matching.py").write_text(text)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", CLASSES]
        command += [f"--dtype={args.dtype}", "tests/feature/test_matching.py"]
        return subprocess.run(command, cwd=root).returncode


if __name__ == "__main__":
    sys.exit(main())
