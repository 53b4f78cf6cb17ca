"""Work shared out over threads that each run torch's CPU operators alone.

torch's CPU operators each end in a barrier of the OpenMP pool; a search or an alignment runs a
few thousand small ones per call, and on a busy machine every barrier waits for the thread the
scheduler took away. Here work is cut into items taken by worker threads in turn, each worker
running its operators on itself alone: no barrier inside an item, and a worker that is slowed
down only takes fewer items. ``torch.set_num_threads`` called in a thread sets that thread's
own OpenMP and MKL counts (and the default of threads started later, put back on exit). The
threads are kept between calls (forgotten in a forked child, where they do not exist).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from ._oprules import transformed

__all__ = ["ITEMS_PER_WORKER", "THREADED", "own_thread", "scratch", "share_out", "share_size", "workers_for"]

T = TypeVar("T")

# Whether CPU work is shared out over worker threads (benchmarks switch it off to compare)
THREADED = True
# Items per worker at least, so that the items left when one worker is slowed down are few
ITEMS_PER_WORKER = 4


def traced() -> bool:
    """Whether this thread's operators reach something other than memory: a torch dispatch mode
    (FakeTensorMode, whose tensors have no storage, and which other threads do not share),
    torch.compile's tracing, or torch.jit.trace's (which records only torch operators called on
    this thread), or a torch.func transform (whose wrapped tensors have no storage of their own).
    Neither C kernels nor worker threads may run then."""
    return transformed()


def workers_for(device: torch.device) -> int:
    """Worker threads for work on ``device``: one per intra-op thread of the caller on a CPU,
    one elsewhere (a GPU's kernels do not wait on CPU barriers) or while :func:`traced`."""
    if not THREADED or device.type != "cpu" or traced():
        return 1
    return max(1, torch.get_num_threads())


def share_size(total: int, workers: int, items: int | None = None) -> int:
    """The largest share of ``total`` units that still cuts them into ``items`` items per worker
    (default :data:`ITEMS_PER_WORKER`; at least 1 unit)."""
    return max(1, -(-total // ((ITEMS_PER_WORKER if items is None else items) * workers)))


@contextlib.contextmanager
def own_thread() -> Iterator[None]:
    """torch's CPU operators inside run on the calling thread alone; the caller's count comes
    back on exit. Nothing while :func:`traced` (a graph being made holds no threads)."""
    if traced():
        yield
        return
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
    and zero on every first touch). The caller must be done with it before asking again. Made
    outside inference mode: a buffer first asked for inside it may be written outside it later
    (an inference tensor refuses that), and a normal one takes writes inside it too."""
    store: dict[str, torch.Tensor] = _buffers.__dict__.setdefault("store", {})
    size = 1
    for n in shape:
        size *= n
    held = store.get(name)
    if held is None or held.numel() < size or held.dtype != dtype or held.device != device:
        with torch.inference_mode(False):
            held = store[name] = torch.empty(size, dtype=dtype, device=device)
    return held[:size].view(shape)


class _Worker:
    """A thread kept between calls, running the jobs put on its queue in turn."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="densematch-worker", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()


# Idle workers: starting two threads took about 1.3 ms on a 2-core VM, once per shared-out step
# (a search shares out four), so they are kept between calls
_idle: list[_Worker] = []
_idle_lock = threading.Lock()


def _take(n: int) -> list[_Worker]:
    with _idle_lock:
        taken = [_idle.pop() for _ in range(min(n, len(_idle)))]
    return taken + [_Worker() for _ in range(n - len(taken))]


def _give_back(workers: list[_Worker]) -> None:
    with _idle_lock:
        _idle.extend(workers)


def _forget_workers() -> None:
    """In a forked child: the parent's threads do not exist there."""
    global _idle_lock
    _idle.clear()
    _idle_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def share_out(items: Sequence[T], work: Callable[[T], None], workers: int, *, name: str = "densematch") -> None:
    """Call ``work(item)`` for every item, on ``workers`` threads (kept between calls) that each
    take the next item when done and run on themselves alone (:func:`own_thread`); their
    :func:`scratch` buffers are let go at the end. The caller's grad and inference
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
    pending = iter(items)
    errors: list[BaseException] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    pool = _take(min(workers, len(items)))
    finished = threading.Semaphore(0)

    def run(i: int, worker: _Worker) -> None:
        threading.current_thread().name = f"{name}-{i}"
        try:
            with own_thread(), torch.inference_mode(inference), torch.set_grad_enabled(grad):
                while not errors:
                    with lock:
                        item = next(pending, _DONE)
                    if item is _DONE:
                        return
                    work(item)  # type: ignore[arg-type]
        except BaseException as e:  # handed to the caller below
            errors.append(e)
        finally:
            _buffers.__dict__.pop("store", None)  # scratch tiles live for one call, as its threads did
            _give_back([worker])  # by the worker itself: even a caller interrupted meanwhile loses none
            finished.release()

    # each worker runs in a copy of the caller's context: scoped settings (config_context) hold
    for i, worker in enumerate(pool):
        worker.jobs.put(functools.partial(contextvars.copy_context().run, run, i, worker))
    try:
        for _ in pool:
            finished.acquire()
    except BaseException as e:  # interrupted: the workers take no new item
        errors.append(e)
        raise
    if errors:
        raise errors[0]


_DONE = object()
