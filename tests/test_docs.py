"""Every python example in docs/ and the README runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_examples_run(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    for block in blocks:
        exec(compile(block, str(page), "exec"), {})
