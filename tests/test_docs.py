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
    # and a public module that moved into a package
    from densematch.options import MatchOptions

    from densematch import MatchOptions as exported
    from densematch import matching, options

    assert options is matching.options and MatchOptions is exported


def test_the_choosing_guide_is_linked_from_the_readme_and_every_public_function():
    import densematch

    assert "docs/choosing.md" in (ROOT / "README.md").read_text()
    public = ["match", "local_match", "local_cost_volume", "soft_match", "pairwise_distance", "nearest_prototype"]
    for name in [*public, "knn", "align"]:
        assert "docs/choosing.md" in getattr(densematch, name).__doc__, name
    # every section the guide quotes a figure from exists under that name, in BENCHMARKS.md or
    # in the history it links
    quoted = [" ".join(q.split()) for q in re.findall(r'\("([^"]+)"', (ROOT / "docs" / "choosing.md").read_text())]
    pages = [ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks" / "history").glob("*.md"))]
    headings = "\n".join(line for page in pages for line in page.read_text().splitlines() if line.startswith("#"))
    assert quoted and all(q in headings for q in quoted), [q for q in quoted if q not in headings]


def test_the_guides_leave_each_argument_to_the_api_reference():
    # a hand-written table of a function's arguments drifts from its docstring: the guides give
    # the narrative and the examples, the reference (docs/api, from the docstrings) the arguments
    import inspect

    import densematch

    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        assert not re.search(r"^\|\s*(argument|parameter)s?\s*\|", text, flags=re.M | re.I), page.name
        for name in densematch.__all__:
            fn = getattr(densematch, name)
            if not inspect.isfunction(fn):
                continue
            params = [p for p in inspect.signature(fn).parameters if len(p) > 1]
            rows = set(re.findall(r"^\|\s*`(\w+)`", text, flags=re.M))
            # a few of a function's options in a table of choices is narrative; most of them is its signature again
            assert len(rows & set(params)) < max(4, len(params) // 2), (page.name, name, sorted(rows & set(params)))


def test_benchmarks_are_a_short_reference_over_a_linked_history():
    reference = (ROOT / "BENCHMARKS.md").read_text()
    assert len(reference.splitlines()) <= 300
    history = ROOT / "benchmarks" / "history"
    index = (history / "README.md").read_text()
    for page in history.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name
    # every history page and every file the docs and the code point at is there
    cited = set(re.findall(r"benchmarks/history/([\w.-]+\.md)", reference))
    for doc in [*(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]:
        cited |= set(re.findall(r"benchmarks/history/([\w.-]+\.md)", doc.read_text()))
    missing = sorted(name for name in cited if not (history / name).exists())
    assert cited and not missing, missing
    assert "## GPU" in reference  # says plainly what is not measured


def test_every_benchmark_script_is_listed_in_its_readme_under_its_folder():
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    sections = dict(zip(("suites", "studies"), listed.split("## Studies"), strict=True))
    assert "## Suites" in sections["suites"]
    loose = [p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_")]
    assert loose == [], f"{loose}: a benchmark goes in suites/ (a public comparison) or studies/"
    for folder, text in sections.items():
        scripts = sorted(p.name for p in (ROOT / "benchmarks" / folder).glob("*.py"))
        assert scripts, folder
        assert [name for name in scripts if f"| {name} |" not in text] == [], folder
        # the command beside each names the script where it is
        assert [name for name in scripts if f"benchmarks/{folder}/{name}" not in text] == [], folder


def test_the_api_reference_builds_without_warnings_and_names_every_public_name(tmp_path):
    # make docs: Sphinx over the docstrings, warnings as errors (a docstring that rST misreads)
    import subprocess
    import sys

    index = (ROOT / "docs" / "api" / "index.rst").read_text()
    import densematch

    missing = [n for n in densematch.__all__ if n != "__version__" and f"densematch.{n}\n" not in index]
    assert missing == []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(ROOT / "docs" / "api"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page = (tmp_path / "index.html").read_text()
    assert "densematch.nearest_prototype" in page and "Parameters" in page
