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


def say(message: str, *, bar: bool, file: Any = None) -> None:
    """Print one line (to ``file``, default stderr) above a running tqdm bar when ``bar``, so
    that it never lands inside the bar's line; plainly otherwise."""
    import sys

    file = sys.stderr if file is None else file
    if bar:
        from tqdm.auto import tqdm

        tqdm.write(message, file=file)
    else:
        print(message, file=file)
