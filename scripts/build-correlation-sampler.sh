#!/usr/bin/env bash
# Installs spatial-correlation-sampler 0.5.0, a peer in benchmarks/suites/bench_local.py, into the
# project's virtual environment on CPU-only torch. Its setup.py always builds the CUDA extension
# and its C++ interface includes a CUDA header unconditionally, so a plain `pip install` fails
# without CUDA. This fetches the sdist (checked against its published sha256), switches the
# package's own CPU_ONLY flag on, guards that one include, and builds it against the torch
# already installed. Needs network access to PyPI and a C++ compiler.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
URL=https://files.pythonhosted.org/packages/66/dd/a0caccedffdbe27c94851eb1faba5d61c86aacf161005580249550dd969b/spatial_correlation_sampler-0.5.0.tar.gz
SHA256=872d720d3740f3caf0d15620af5180af8a1971568f9c7cda3664757262688d11

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -sSfL "$URL" -o "$work/src.tar.gz"
echo "$SHA256  $work/src.tar.gz" | sha256sum -c --quiet
tar xzf "$work/src.tar.gz" -C "$work"
src="$work/spatial_correlation_sampler-0.5.0"
sed -i 's/^CPU_ONLY = False$/CPU_ONLY = True/' "$src/setup.py"
sed -i 's|^#include <c10/cuda/CUDAGuard.h>$|#ifdef USE_CUDA\n#include <c10/cuda/CUDAGuard.h>\n#endif|' \
    "$src/Correlation_Module/correlation_sampler.cpp"
grep -q '^CPU_ONLY = True$' "$src/setup.py"
"$PY" -m pip install --quiet --no-build-isolation --no-deps "$src"
"$PY" -c "import spatial_correlation_sampler as s; print('installed', s.__file__)"
