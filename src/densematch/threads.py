"""Work shared out over threads that each run torch's CPU operators alone.

torch's CPU operators each end in a barrier of the OpenMP pool; a search or an alignment runs a
few thousand small ones per call, and on a busy machine every barrier waits for the thread the
scheduler took away. Here work is cut into items taken by worker threads in turn, each worker
running its operators on itself alone: no barrier inside an item, and a worker that is slowed
down only takes fewer items. ``torch.set_num_threads`` called in a thread sets that thread's
own OpenMP and MKL counts (and the default of threads started later, put back on exit).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

__all__ = ["THREADED", "own_thread", "scratch", "share_out", "share_size", "workers_for"]

T = TypeVar("T")

# Whether CPU work is shared out over worker threads (benchmarks switch it off to compare)
THREADED = True
# Items per worker at least, so that the items left when one worker is slowed down are few
ITEMS_PER_WORKER = 4


def workers_for(device: torch.device) -> int:
    """Worker threads for work on ``device``: one per intra-op thread of the caller on a CPU,
    one elsewhere (a GPU's kernels do not wait on CPU barriers)."""
    if not THREADED or device.type != "cpu":
        return 1
    return max(1, torch.get_num_threads())


def share_size(total: int, workers: int) -> int:
    """The largest share of ``total`` units that still cuts them into :data:`ITEMS_PER_WORKER`
    items per worker (at least 1)."""
    return max(1, -(-total // (ITEMS_PER_WORKER * workers)))


@contextlib.contextmanager
def own_thread() -> Iterator[None]:
    """torch's CPU operators inside run on the calling thread alone; the caller's count comes
    back on exit."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_buffers = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of this thread's, kept between calls under ``name`` and grown when too small: a
    tile written and read again at once needs no fresh block (whose pages the kernel would map
    and zero on every first touch). The caller must be done with it before asking again."""
    store: dict[str, torch.Tensor] = _buffers.__dict__.setdefault("store", {})
    size = 1
    for n in shape:
        size *= n
    held = store.get(name)
    if held is None or held.numel() < size or held.dtype != dtype or held.device != device:
        held = store[name] = torch.empty(size, dtype=dtype, device=device)
    return held[:size].view(shape)


def share_out(items: Sequence[T], work: Callable[[T], None], workers: int, *, name: str = "densematch") -> None:
    """Call ``work(item)`` for every item, on ``workers`` threads that each take the next item
    when done and run on themselves alone (:func:`own_thread`). The caller's grad and inference
    modes and its context variables (:func:`densematch.config_context`) hold in the workers.
    The first error is raised here, once every worker has stopped (the others take no new item
    after it). With one worker the items run here, in order, with the caller's threads; a single
    item runs here on this thread alone."""
    if workers <= 1:
        for item in items:
            work(item)
        return
    if len(items) <= 1:
        with own_thread():
            for item in items:
                work(item)
        return
    lock = threading.Lock()
    queue = iter(items)
    errors: list[BaseException] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def run() -> None:
        try:
            with own_thread(), torch.inference_mode(inference), torch.set_grad_enabled(grad):
                while not errors:
                    with lock:
                        item = next(queue, _DONE)
                    if item is _DONE:
                        return
                    work(item)  # type: ignore[arg-type]
        except BaseException as e:  # handed to the caller below
            errors.append(e)

    # each worker runs in a copy of the caller's context: scoped settings (config_context) hold
    pool = [
        threading.Thread(target=contextvars.copy_context().run, args=(run,), name=f"{name}-{i}")
        for i in range(min(workers, len(items)))
    ]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


_DONE = object()
