"""densematch's C kernels for the CPU, called through ctypes, under one name: the loader
(:mod:`.loader`: building, caching, loading the library and the boundary every call passes) and
the bindings, one module per C source: :mod:`.c_engine` (native.c: l1 / linf distances and their
gradients, the elementwise passes around l2's product, the engine's tile merge with its
candidate listing, the certified bfloat16 step, the values of chosen row pairs), :mod:`.c_local`
(native.c's local windows) and :mod:`.c_align` (align.c and certify.c). Callers write
``native.merge(...)``; a new kernel is its C body, its line in ``dm_abi.h`` and its wrapper in
the binding module of its source.

``python -m densematch.kernels.native`` builds this machine's library and prints where it went
(``make`` calls :func:`build` itself while setting up: run as a module, this file is imported
twice, which runpy warns of).
"""

from __future__ import annotations

from . import c_align, c_engine, c_local, loader
from .c_align import *  # noqa: F403
from .c_engine import *  # noqa: F403
from .c_local import *  # noqa: F403
from .loader import *  # noqa: F403

__all__ = sorted({*loader.__all__, *c_engine.__all__, *c_local.__all__, *c_align.__all__})

if __name__ == "__main__":
    print(build())  # noqa: F405
