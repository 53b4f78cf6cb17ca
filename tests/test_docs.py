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


def _resolves(dotted: str) -> bool:
    """Whether ``densematch.a.b.c`` names something: the longest importable module prefix, then
    attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_name_the_docs_give_resolves_and_imports():
    # docs/batch.md names densematch.batch.Pair; `from densematch.batch import Pair` raised
    # ModuleNotFoundError where only the attribute existed
    names, imports = set(), set()
    for page in PAGES:
        text = page.read_text()
        names.update(re.findall(r"\bdensematch(?:\.[A-Za-z_]\w*)+", text))
        imports.update(re.findall(r"from (densematch(?:\.\w+)*) import (\w+)", text))
    unresolved = sorted(n.rstrip(".") for n in names if not _resolves(n.rstrip(".")))
    assert unresolved == []
    for module, name in sorted(imports):
        exec(f"from {module} import {name}", {})
    # the application's modules under their old names are the very modules of densematch.app
    from densematch.batch import Pair, run

    from densematch import app, synthetic

    assert synthetic is app.synthetic and Pair is app.batch.Pair and run is app.batch.run


def test_the_choosing_guide_is_linked_from_the_readme_and_every_public_function():
    import densematch

    assert "docs/choosing.md" in (ROOT / "README.md").read_text()
    public = ["match", "local_match", "local_cost_volume", "soft_match", "pairwise_distance", "nearest_prototype"]
    for name in [*public, "knn", "align"]:
        assert "docs/choosing.md" in getattr(densematch, name).__doc__, name
    # every section of BENCHMARKS.md the guide quotes a figure from exists under that name
    quoted = [" ".join(q.split()) for q in re.findall(r'\("([^"]+)"', (ROOT / "docs" / "choosing.md").read_text())]
    headings = "\n".join(line for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("#"))
    assert quoted and all(q in headings for q in quoted), [q for q in quoted if q not in headings]
