"""Progress bars: tqdm when asked for, a no-op otherwise (tqdm is imported only when used)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(enabled: bool, **options: Any) -> Iterator[Any]:
    """Yield an object with ``update(n)``: a tqdm bar when ``enabled``, else a silent stand-in."""
    if not enabled:
        yield _Silent()
        return
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError("progress=True needs tqdm; install it with pip install 'densematch[progress]'") from err
    with tqdm(**options) as bar:
        yield bar
