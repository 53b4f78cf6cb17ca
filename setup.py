"""The package build's one step beyond pyproject.toml: densematch's C kernels, compiled into the
wheel once per instruction-set level (src/densematch/kernels/build.py says which and how), so
that an installed package needs no compiler. Where the compiler fails, the package still builds
and the kernels are compiled at first use instead (or torch's run, with a warning)."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install builds them into the cache at first use
            build = runpy.run_path(str(Path(__file__).parent / "src" / "densematch" / "kernels" / "build.py"))
            build["build_all"](Path(self.build_lib) / "densematch" / "kernels")


class PlatformWheel(bdist_wheel):
    """ctypes loads the libraries: any Python 3 on this platform runs them (py3-none-<platform>),
    and on Linux a manylinux platform where they need no more than its policy allows
    (src/densematch/kernels/wheeltag.py reads them)."""

    def get_tag(self) -> tuple[str, str, str]:
        platform = super().get_tag()[2]
        libraries = sorted(Path(self.bdist_dir).rglob("densematch/kernels/*.so")) if self.bdist_dir else []
        if libraries:
            wheeltag = runpy.run_path(str(Path(__file__).parent / "src" / "densematch" / "kernels" / "wheeltag.py"))
            platform = wheeltag["platform_tag"](libraries, platform)
        return "py3", "none", platform


class PlatformDistribution(Distribution):
    """Binary libraries inside: the wheel is tagged for this platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildWithKernels, "bdist_wheel": PlatformWheel}, distclass=PlatformDistribution)
