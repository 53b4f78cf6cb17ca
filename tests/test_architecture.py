"""The import contracts of docs/design.md, read from the source: the core never imports the
application layer, and nothing below the public functions reads the configuration."""

import ast
from pathlib import Path

import pytest
import torch

import densematch
from densematch import config, engine
from densematch.metrics import get_metric
from densematch.precision import Precision

from ._reference import assert_same_up_to_ties

SOURCE = Path(densematch.__file__).parent
# below the public functions: handed a budget and a Precision, they read no global setting
BELOW_BOUNDARY = (
    "engine",
    "kernels",
    "metrics",
    "threads",
    "checks",
    "budget",
    # align's search, refinement and warps, and local windows' steps: their public functions
    # (alignment.api, alignment.certify, local.api) read the settings and hand them down
    "alignment.search",
    "alignment.refine",
    "alignment.warp",
    "local.windows",
    "local.volume",
    "local.topk",
    "local.op",
    # the prototype distances' tiled work (distances.prototypes reads the settings)
    "distances.tiles",
    "ops",
)


def _module(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every densematch module ``path`` imports, at any depth of the file, resolved to full names."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("densematch")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("densematch"):
                # "from . import x" names modules; "from .m import f" names the module m
                found |= {f"{target}.{a.name}" for a in node.names} if node.module is None else {target}
    return found


def _files(prefix: str = "") -> list[Path]:
    return sorted(p for p in SOURCE.rglob("*.py") if _module(p).startswith(f"densematch{prefix}"))


def test_the_parser_sees_imports_at_every_depth():
    imported = _imports(SOURCE / "app" / "cli.py")
    assert "densematch.distributed" in imported  # imported inside a function
    assert "densematch.matching.dense" in imported and "densematch.app.tasks" in imported


# ``python -m densematch`` is the command's launcher: application too
APPLICATION = ("densematch.app", "densematch.__main__")


@pytest.mark.parametrize("path", [p for p in _files() if not _module(p).startswith(APPLICATION)], ids=_module)
def test_the_core_never_imports_the_application_layer(path):
    upward = {m for m in _imports(path) if m == "densematch.app" or m.startswith("densematch.app.")}
    assert not upward, f"{_module(path)} imports {sorted(upward)}: the core must not depend on densematch.app"


@pytest.mark.parametrize("path", [p for name in BELOW_BOUNDARY for p in _files(f".{name}")], ids=_module)
def test_nothing_below_the_boundary_reads_the_config(path):
    assert "densematch.config" not in _imports(path), f"{_module(path)} imports densematch.config"


@pytest.mark.parametrize("name", ["metrics", "ops"])
def test_the_metrics_and_the_operations_import_nothing_from_the_kernels(name):
    # the metrics hold the mathematics and call the Ops they are handed: no type cycle with kernels
    below = {m for m in _imports(SOURCE / f"{name}.py") if m.startswith("densematch.kernels")}
    assert not below, f"densematch.{name} imports {sorted(below)}"


def test_whether_c_may_and_can_run_is_asked_in_one_place():
    # kernels.ops_for answers it once per call; every other module takes the answer handed down
    askers = sorted(
        _module(p) for p in _files() if not _module(p).startswith("densematch.kernels") and "usable(" in p.read_text()
    )
    assert askers == [], f"{askers} ask native.usable themselves: take the call's Ops (kernels.ops_for) instead"


class _Unread:
    """A scoped setting that fails when read."""

    def get(self) -> None:
        raise AssertionError("the engine read the config")


def test_the_engine_takes_its_settings_from_the_precision_alone(monkeypatch):
    a, b = torch.randn(40, 6), torch.randn(50, 6)
    for metric in ("l1", "l2"):
        want = engine.topk(a, b, metric=get_metric(metric), k=2, budget=1 << 20, precision=Precision())
        with monkeypatch.context() as m:
            for var in ("_memory", "_half", "_kernel"):  # every setting config_context scopes
                m.setattr(config, var, _Unread())
            got = engine.topk(a, b, metric=get_metric(metric), k=2, budget=1 << 20, precision=Precision())
            torch_only = engine.topk(
                a, b, metric=get_metric(metric), k=2, budget=1 << 20, precision=Precision(backend="torch")
            )
        assert torch.equal(got[1], want[1])  # the same path twice: the same picks
        # torch's kernels instead of the C ones: the same picks up to float32 near-ties
        assert_same_up_to_ties(a, b, torch_only[1], want[1], metric)


def test_the_application_modules_keep_their_old_names():
    from densematch import app, synthetic
    from densematch.app import batch

    assert synthetic is app.synthetic and densematch.batch is batch and densematch.batch.run is batch.run
