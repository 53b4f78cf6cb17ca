import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import densematch
from densematch.budget import parse_memory
from densematch.config import resolve_memory


def test_import_loads_no_optional_dependency():
    # measured against what torch and numpy load themselves (torch itself imports tqdm when present)
    code = (
        "import sys, numpy, torch; before = set(sys.modules); import densematch; "
        "bad = [m for m in ('tqdm', 'matplotlib', 'PIL', 'skimage', 'triton', 'faiss', 'scipy') "
        "if m in sys.modules and m not in before]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names():
    for name in densematch.__all__:
        assert hasattr(densematch, name), name


PUBLIC_SURFACE = Path(__file__).with_name("public_surface.txt")


def public_surface() -> str:
    """Every public name of densematch, each function's and class's signature, and each public
    method's and property's of the classes, one line each: what a user's code may call."""

    def text(annotation: object) -> str:  # the annotation as written, whatever Python shows it as
        if isinstance(annotation, str):
            return annotation
        return getattr(annotation, "__forward_arg__", None) or inspect.formatannotation(annotation)

    def signature(fn: object) -> str:  # inspect's own form, every annotation as its text
        sig = inspect.signature(fn)  # type: ignore[arg-type]
        params = [
            q if q.annotation is q.empty else q.replace(annotation=text(q.annotation)) for q in sig.parameters.values()
        ]
        result = sig.return_annotation
        return str(sig.replace(parameters=params, return_annotation=result if result is sig.empty else text(result)))

    lines = []
    for name in sorted(densematch.__all__):
        obj = getattr(densematch, name)
        if inspect.isclass(obj):
            lines.append(f"class {name}{signature(obj)}")
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    lines.append(f"    {name}.{attr} (property)")
                elif inspect.isfunction(member):
                    lines.append(f"    {name}.{attr}{signature(member)}")
        elif callable(obj):
            lines.append(f"def {name}{signature(obj)}")
        else:
            lines.append(f"{name}: {type(obj).__name__}")
    return "\n".join(lines) + "\n"


def test_the_public_surface_is_pinned():
    # a change to what users call (a name, a parameter, its kind or default) is a decision, made
    # by rewriting the file, from the repository's root:
    #   python -c "from tests.test_package import public_surface as p; print(p(), end='')" \
    #     > tests/public_surface.txt
    assert public_surface() == PUBLIC_SURFACE.read_text()


def test_options_passed_by_position_still_work_with_a_warning_that_names_them():
    # issue 43: options after the inputs are keyword-only; the old positional calls keep their
    # meaning for now, with a FutureWarning naming each keyword, and a clash or an extra is a TypeError
    x, p = torch.randn(1, 4, 3, 3), torch.randn(5, 4)
    bank = torch.randn(20, 4)
    with pytest.warns(FutureWarning, match="metric="):
        old = densematch.pairwise_distance(x, p, "l1")
    assert torch.equal(old, densematch.pairwise_distance(x, p, metric="l1"))
    with pytest.warns(FutureWarning, match="k=, metric="):
        old_knn = densematch.knn(bank[:3], bank, 2, "cosine")
    new_knn = densematch.knn(bank[:3], bank, k=2, metric="cosine")
    assert torch.equal(old_knn.indices, new_knn.indices)
    with pytest.warns(FutureWarning, match="KNNIndex.search: pass k="):
        old_search = densematch.KNNIndex(bank).search(bank[:3], 2)
    assert torch.equal(old_search.indices, densematch.knn(bank[:3], bank, k=2).indices)
    with pytest.warns(FutureWarning, match="PrototypeDistance.__init__: pass metric="):
        assert densematch.PrototypeDistance(5, 4, "cosine").metric == "cosine"
    with pytest.raises(TypeError, match="both by position and by keyword"):
        densematch.pairwise_distance(x, p, "l1", metric="l2")
    with pytest.raises(TypeError, match="positional arguments"):
        densematch.knn(bank[:3], bank, 2, "l2", "64MiB", "exact", True, "extra")
    for fn in (densematch.pairwise_distance, densematch.nearest_prototype, densematch.knn):
        kinds = [q.kind for q in inspect.signature(fn).parameters.values()][2:]
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind in kinds), fn.__name__


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64MiB", 64 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("4096", 4096),
        ("512k", 512 * 1024),
        (123, 123),
    ],
)
def test_parse_memory(text, value):
    assert parse_memory(text) == value


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("lots", ValueError),
        ("-1MiB", ValueError),
        (0, ValueError),
        (True, TypeError),
        (1.5, TypeError),
        ("3 parsecs", ValueError),
    ],
)
def test_parse_memory_rejects(bad, error):
    with pytest.raises(error, match="memory must be"):
        parse_memory(bad)


def test_default_budget_comes_from_free_memory_and_is_capped(monkeypatch):
    monkeypatch.delenv("DENSEMATCH_MEMORY", raising=False)
    cpu = torch.device("cpu")
    assert 1 <= resolve_memory(None, cpu) <= 512 * 2**20
    monkeypatch.setenv("DENSEMATCH_MEMORY", "3MiB")
    assert resolve_memory(None, cpu) == 3 * 2**20
    with densematch.config_context(memory="5MiB"):
        assert resolve_memory(None, cpu) == 5 * 2**20
        assert resolve_memory("7MiB", cpu) == 7 * 2**20


def test_default_budget_reads_the_available_memory_only_when_unused_ram_is_short(monkeypatch):
    # half of what is available, capped; a host with 4x the cap unused gets the cap without the
    # read of /proc/meminfo
    from densematch import budget

    cpu = torch.device("cpu")
    monkeypatch.setattr(budget, "_unused_ram", lambda: 0)
    monkeypatch.setattr(budget, "free_memory", lambda device: 100 * 2**20)
    assert budget.default_budget(cpu) == 50 * 2**20

    def unread(device: torch.device) -> int:
        raise AssertionError("free_memory read where unused RAM alone covered the cap")

    monkeypatch.setattr(budget, "_unused_ram", lambda: 4 * budget.DEFAULT_CAP_CPU)
    monkeypatch.setattr(budget, "free_memory", unread)
    assert budget.default_budget(cpu) == budget.DEFAULT_CAP_CPU


USER_CODE = """import torch
import densematch


def good(a: torch.Tensor) -> densematch.Matches:
    return densematch.match(a, a, metric="l2", layout="chw", precision="fast")


def bad(a: torch.Tensor) -> densematch.Matches:
    return densematch.match(a, a, metric="l3")


def coords(a: torch.Tensor) -> torch.Tensor:  # Matches.coords was Tensor | None
    return densematch.match(a, a).coords
"""


def test_source_passes_ruff_and_mypy(tmp_path):
    # CI runs only `make test`: the lint and the type check of `make lint` run here too
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, f"ruff:\n{done.stdout}{done.stderr}"
    # and a user's file beside the package, in the same run: metric="l3" type-checked while every
    # choice was a plain str; the choices are Literal types now (densematch.choices)
    user = tmp_path / "user.py"
    user.write_text(USER_CODE)
    done = subprocess.run([sys.executable, "-m", "mypy", "src/densematch", str(user)], cwd=root,
                          capture_output=True, text=True)  # fmt: skip
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "user.py:10: error" in errors[0] and "Literal['l3']" in errors[0], done.stdout


def test_the_choices_equal_what_the_runtime_checks():
    import typing

    from densematch import choices
    from densematch.alignment.api import OBJECTIVES
    from densematch.checks import LAYOUTS
    from densematch.config import HALF_SETTINGS, KERNEL_SETTINGS
    from densematch.local.api import SAMPLINGS
    from densematch.matching.soft import SOFT_MODES
    from densematch.matching.subpixel import REFINES
    from densematch.metrics import METRICS
    from densematch.precision import PRECISIONS

    for alias, runtime in (
        (choices.MetricName, tuple(METRICS)),
        (choices.LayoutName, LAYOUTS),
        (choices.PrecisionName, PRECISIONS),
        (choices.SoftMode, SOFT_MODES),
        (choices.ObjectiveName, OBJECTIVES),
        (choices.SamplingName, SAMPLINGS),
        (choices.RefineName, REFINES),
        (choices.HalfSetting, HALF_SETTINGS),
        (choices.KernelSetting, KERNEL_SETTINGS),
    ):
        assert typing.get_args(alias) == tuple(runtime)
