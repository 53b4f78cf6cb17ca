"""Thousands of pairs: a resumable batch runner, in one process, a pool of processes, or on a Ray
cluster.

:func:`run` yields one record per pair; given ``out_dir`` it also keeps ``results.jsonl`` there
(one JSON line per pair, appended as each finishes) and writes each pair's arrays and picture
beside it, every file atomically. A second run with the same ``out_dir`` skips the pairs already
"ok" and retries the errors. Workers compute; the driver alone writes, so a cluster's workers
need to read the inputs, never to share the output folder.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import check_bool
from ..progress import progress_bar
from .io import atomic_write, save_arrays, save_with
from .tasks import PairResult, align_pairs, align_warnings, distance_pair, match_pair, picture_bytes
from .view import batch_page, write_page

__all__ = ["COLUMNS", "ENGINES", "INDEX", "RESULTS", "Pair", "read_manifest", "read_results", "run", "write_index"]

COLUMNS = {"align": ("template", "image"), "match": ("a", "b"), "distance": ("features", "prototypes")}
ENGINES = ("local", "ray")
RESULTS = "results.jsonl"
INDEX = "index.html"  # the pages' index, beside results.jsonl
Extras = tuple[bool, bool]  # what each pair also gives: its picture, its page
# pairs per unit of work: align batches pairs of one shape within a chunk; the others gain nothing
CHUNK = {"align": 16, "match": 1, "distance": 1}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FAILURES = (ValueError, TypeError, OSError, ImportError, RuntimeError, MemoryError)


@dataclass(frozen=True)
class Pair:
    """One row of a manifest: its ``id`` and its input paths by column name."""

    id: str
    inputs: dict[str, str]


def _check_task(task: str) -> tuple[str, str]:
    if task not in COLUMNS:
        raise ValueError(f"task must be one of {', '.join(COLUMNS)}, got {task!r}")
    return COLUMNS[task]


def _check_id(value: str, where: str) -> str:
    if not _ID.match(value):
        raise ValueError(
            f"{where}: id {value!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
            "digit (it names the pair's output files)"
        )
    if value.casefold() == Path(INDEX).stem:
        raise ValueError(f"{where}: id {value!r} is reserved: its page would be the batch's own {INDEX}; rename it")
    return value


def _check_unique(seen: dict[str, str], pair_id: str, where: str) -> None:
    """Add ``pair_id`` to ``seen`` (case-folded id -> id), refusing one given before: ids name
    files, and two that differ only in case are one file where names ignore case (macOS,
    Windows)."""
    other = seen.get(pair_id.casefold())
    seen[pair_id.casefold()] = pair_id
    if other is not None:
        same = "appears twice" if other == pair_id else f"differs from id {other!r} only in case"
        raise ValueError(f"{where}: id {pair_id!r} {same}; ids must be unique (ignoring case: they name files)")


def read_manifest(path: str | os.PathLike[str], task: str) -> list[Pair]:
    """The pairs of a CSV manifest with a header: ``template,image`` (align), ``a,b`` (match) or
    ``features,prototypes`` (distance), and optionally ``id`` (default: the row number, from 1).
    Relative paths are taken relative to the manifest's folder.

    Raises
    ------
    ValueError
        A missing column, an empty cell, an id that cannot name a file, or an id given twice.
    """
    columns = _check_task(task)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"MANIFEST {str(p)!r} does not exist or is not a file")
    try:
        return _read_pairs(p, columns, task)
    except UnicodeDecodeError:
        raise ValueError(
            f'MANIFEST {str(p)!r} is not UTF-8 text; save it as UTF-8 (a spreadsheet\'s "CSV UTF-8"), or convert it '
            "with iconv -t UTF-8"
        ) from None


def _read_pairs(p: Path, columns: tuple[str, ...], task: str) -> list[Pair]:
    # utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark, which must not join
    # the first column's name
    with open(p, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [c for c in columns if c not in header]
        if missing:
            raise ValueError(
                f"MANIFEST {str(p)!r} must have a header with columns {', '.join(columns)} (and optionally id) "
                f"for {task}; missing {', '.join(missing)}, found {', '.join(header) or 'no header'}"
            )
        pairs: list[Pair] = []
        seen: dict[str, str] = {}
        for number, row in enumerate(reader, start=1):
            row = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
            where = f"MANIFEST {str(p)!r} row {number}"
            pair_id = _check_id(row.get("id") or str(number), where)
            _check_unique(seen, pair_id, where)
            empty = [c for c in columns if not row[c]]
            if empty:
                raise ValueError(f"{where}: empty {', '.join(empty)}")
            pairs.append(Pair(pair_id, {c: str(p.parent / row[c]) for c in columns}))
    return pairs


def _solve(task: str, pairs: Sequence[Pair], options: dict[str, Any], extras: Extras) -> list[dict[str, Any]]:
    """Worker side: one chunk of pairs, each to a record with its arrays, picture and page
    attached (``_arrays``, ``_picture``, ``_page``: taken off by the driver). Never raises for a
    bad pair."""
    pictures, pages = extras
    started = time.perf_counter()
    first, second = COLUMNS[task]
    outcomes: list[PairResult | Exception]
    if task == "align":
        try:
            with warnings.catch_warnings():  # a scale at its bound goes into the pair's record
                warnings.simplefilter("ignore", UserWarning)
                outcomes = align_pairs(
                    [(p.inputs[first], p.inputs[second]) for p in pairs], viz=pictures, page=pages, **options
                )
        except Exception as err:  # an option that fails every pair (a bad --mask)
            outcomes = [err] * len(pairs)
    else:
        outcomes = []
        for p in pairs:
            try:
                if task == "match":
                    r = match_pair(p.inputs[first], p.inputs[second], viz=pictures, page=pages, **options)
                else:
                    r = distance_pair(p.inputs[first], p.inputs[second], page=pages, **options)
                outcomes.append(r if r is not None else RuntimeError("no result"))
            except Exception as err:
                outcomes.append(err)
    seconds = round((time.perf_counter() - started) / max(1, len(pairs)), 4)
    records = []
    for p, outcome in zip(pairs, outcomes, strict=True):
        if isinstance(outcome, Exception):
            message = str(outcome).splitlines()[0] if str(outcome) else type(outcome).__name__
            if not isinstance(outcome, _FAILURES):
                message = f"{type(outcome).__name__}: {message}"
            records.append(_record(p, seconds, error=message))
        else:
            picture = picture_bytes(outcome.figure) if outcome.figure is not None else None
            said = align_warnings(outcome.result, options.get("objective", "l1")) if task == "align" else []
            records.append(
                _record(p, seconds, result=outcome.result, _arrays=outcome.arrays, _picture=picture, _page=outcome.page)
            )
            if said:
                records[-1]["warning"] = "; ".join(said)
    return records


def _record(
    pair: Pair, seconds: float | None, *, error: str | None = None, result: Any = None, **extra: Any
) -> dict[str, Any]:
    """One line of results.jsonl: an error, or an ok result (with what the driver writes)."""
    status = "error" if error is not None else "ok"
    return {
        "id": pair.id,
        "inputs": pair.inputs,
        "status": status,
        "error": error,
        "result": result,
        "seconds": seconds,
        **extra,
    }


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _local(
    task: str, chunks: list[list[Pair]], options: dict[str, Any], extras: Extras, workers: int
) -> Generator[list[dict[str, Any]], None, None]:
    if workers <= 1:
        for chunk in chunks:
            yield _solve(task, chunk, options, extras)
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: a forked child would inherit torch's OpenMP pool in an undefined state
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(threads,))
    try:
        pending: dict[Future[list[dict[str, Any]]], list[Pair]] = {
            pool.submit(_solve, task, chunk, options, extras): chunk for chunk in chunks
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                chunk = pending.pop(future)
                try:
                    yield future.result()
                except Exception as err:  # the worker died (killed, out of memory): its pairs failed
                    yield [_lost(p, err) for p in chunk]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _lost(pair: Pair, err: BaseException) -> dict[str, Any]:
    message = str(err).splitlines()[0] if str(err) else ""
    return _record(pair, None, error=f"worker failed ({type(err).__name__}{': ' + message if message else ''})")


def _ray(
    task: str, chunks: list[list[Pair]], options: dict[str, Any], extras: Extras, workers: int, address: str | None
) -> Generator[list[dict[str, Any]], None, None]:
    try:
        ray: Any = importlib.import_module("ray")  # untyped: used as Any
    except ImportError as err:
        raise ImportError("engine='ray' needs Ray: pip install 'densematch[ray]'") from err
    started = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        local = {} if address else {"num_cpus": workers if workers > 1 else None}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **local)
        started = True
    try:
        gpus = 1 if options.get("device") == "cuda" and ray.cluster_resources().get("GPU", 0) >= 1 else 0
        threads = 1 if workers <= 1 else max(1, int(ray.cluster_resources().get("CPU", 1)) // workers)
        remote = ray.remote(num_cpus=1, num_gpus=gpus, max_retries=0)(_ray_solve)
        pending = {remote.remote(task, chunk, options, extras, threads): chunk for chunk in chunks}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                chunk = pending.pop(ref)
                try:
                    yield ray.get(ref)
                except Exception as err:  # a worker that died or could not be scheduled
                    yield [_lost(p, err) for p in chunk]
    finally:
        if started:
            ray.shutdown()


def _ray_solve(
    task: str, pairs: Sequence[Pair], options: dict[str, Any], extras: Extras, threads: int
) -> list[dict[str, Any]]:
    _init_worker(threads)
    return _solve(task, pairs, options, extras)


LOCK = ".densematch-batch.lock"


def _parse(line: bytes) -> dict[str, Any] | None:
    """A line of results.jsonl as a record, or None when it is not one (half-written)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "id" in record else None


class _Results:
    """``results.jsonl``: the last record of each id, one line per record, appended; a last line
    left half-written by an interrupted run is cut off before the next is appended (a last line
    that parses is complete, final newline or not). The folder is locked for the run: a second
    run into it stops at once, naming the process that holds it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self.lock = _lock(path.parent / LOCK)
        try:
            self._load()
            self.fh = open(path, "ab")
        except BaseException:
            self.lock.close()
            raise

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        tail = data[len(whole) :]
        if tail.strip() and _parse(tail) is not None:
            whole = data + b"\n"  # a complete last line without its newline (a hand edit)
        for number, line in enumerate(whole.splitlines(), start=1):
            record = _parse(line)
            if record is None:
                continue
            try:
                _line(record)
            except ValueError as err:  # NaN or Infinity: json reads them, but never writes them
                raise ValueError(
                    f"{self.path} line {number} cannot be written back ({err}): "
                    "remove that line or replace its NaN / Infinity with null, then run again"
                ) from err
            self.records[str(record["id"])] = record
        if whole != data:
            with open(self.path, "r+b") as fh:
                if len(whole) < len(data):
                    fh.truncate(len(whole))
                else:
                    fh.seek(0, os.SEEK_END)
                    fh.write(b"\n")

    def done(self, pair_id: str) -> bool:
        return self.records.get(pair_id, {}).get("status") == "ok"

    def add(self, record: dict[str, Any]) -> None:
        self.records[record["id"]] = record
        self.fh.write(_line(record).encode())
        self.fh.flush()

    def close(self, order: Sequence[str] | None = None) -> None:
        """Close; given the manifest's ids, rewrite the file as the last record of each, in
        that order (then any other ids it holds), atomically: a run resumed after an
        interruption ends with the same file as one that never stopped. Then unlock."""
        try:
            self.fh.close()
            if order is not None:
                ids = [i for i in order if i in self.records]
                known = set(ids)
                ids += [i for i in self.records if i not in known]
                with atomic_write(self.path) as fh:
                    fh.write("".join(_line(self.records[i]) for i in ids).encode())
        finally:
            self.lock.close()


def _lock(path: Path) -> Any:
    """An exclusive lock on ``path`` (created) for as long as the returned file stays open,
    holding this process's id and host; a ValueError naming the holder when another has it.
    Where fcntl does not exist (Windows) the file is opened without a lock."""
    fh = open(path, "a+")
    try:
        import fcntl
    except ImportError:
        return fh
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise ValueError(
            f"out_dir {str(path.parent)!r} is in use by another batch run ({holder}); "
            "wait for it to finish, or give another folder"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {platform.node() or 'this host'}")
    fh.flush()
    return fh


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=False, default=_plain) + "\n"


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write_outputs(record: dict[str, Any], out_dir: Path) -> None:
    """The pair's arrays (``<id>.npz``, or ``<id>.npy`` for a lone distance array) and picture
    (``<id>.png``), atomically; their names go into the record's result."""
    arrays, picture, page = record.pop("_arrays", None), record.pop("_picture", None), record.pop("_page", None)
    if arrays:
        name = f"{record['id']}{'.npy' if list(arrays) == ['distance'] else '.npz'}"
        save_arrays(out_dir / name, arrays, single="distance")
        record["result"]["output"] = name
    if picture is not None:
        name = f"{record['id']}.png"
        save_with(out_dir / name, lambda fh: fh.write(picture))
        record["result"]["picture"] = name
    if page is not None:
        name = f"{record['id']}.html"
        write_page(out_dir / name, page)
        record["result"]["page"] = name


def run(
    task: str,
    pairs: Iterable[Pair | tuple[str, str]],
    *,
    engine: str = "local",
    workers: int = 1,
    out_dir: str | os.PathLike[str] | None = None,
    ray_address: str | None = None,
    viz: bool = False,
    html: bool = False,
    progress: bool = False,
    on_skip: Callable[[Pair], None] | None = None,
    **options: Any,
) -> Iterator[dict[str, Any]]:
    """Run ``task`` on every pair, yielding one record per pair as it finishes.

    Parameters
    ----------
    task : {"align", "match", "distance"}
    pairs : iterable of Pair, or of (path, path) tuples (ids: their positions, from 1)
        As :func:`read_manifest` gives them.
    engine : {"local", "ray"}, default="local"
        "local": this process, or ``workers`` processes. "ray": tasks on a Ray cluster at
        ``ray_address`` (else ``RAY_ADDRESS``, else a local one started here and stopped at the
        end; an initialised Ray is used as it is), one GPU each where ``device="cuda"`` and the
        cluster has GPUs.
    workers : int, default=1
        Processes (local), or CPUs of the local Ray cluster started here; threads per worker
        are the cores divided among them.
    out_dir : path, optional
        Keep ``results.jsonl`` and each pair's outputs here (the folder is created), and skip
        the pairs already "ok" there. Without it, an "ok" record of match or distance carries
        its arrays under "arrays", and nothing is written.
    viz : bool, default=False
        With ``out_dir``: write each pair's picture as ``<id>.png``.
    html : bool, default=False
        With ``out_dir``: write each pair's page as ``<id>.html``, and at the end ``index.html``
        over every pair of ``results.jsonl`` (:mod:`densematch.app.view`).
    progress : bool, default=False
        A tqdm bar over the pairs, with their rate.
    on_skip : callable, optional
        Called with each pair skipped as already done.
    **options
        The task's options, applied to every pair: :func:`densematch.align`'s keywords and
        ``mask`` (a path); :func:`densematch.match`'s and ``features``, ``device``;
        ``metric``, ``nearest``, ``k``, ``precision``, ``memory`` for distance.

    Yields
    ------
    dict
        ``id``, ``inputs``, ``status`` ("ok" or "error"), ``error`` (one line, or None),
        ``result`` (align: scale_h, scale_w, shift_y, shift_x, error; match: valid fraction,
        mean score, shapes and the output's name; distance: shape, mean and output's name) and
        ``seconds`` (the pair's share of its chunk's time).

    Examples
    --------
    >>> import tempfile, numpy as np, densematch
    >>> folder = tempfile.mkdtemp()
    >>> image = np.random.default_rng(0).random((40, 40))
    >>> np.save(f"{folder}/image.npy", image)
    >>> np.save(f"{folder}/template.npy", densematch.warp(image, 1.0, 1.0, 3.0, 2.0, (30, 30)).numpy())
    >>> [r] = densematch.batch.run("align", [(f"{folder}/template.npy", f"{folder}/image.npy")])
    >>> r["status"], round(r["result"]["shift_y"], 2), round(r["result"]["shift_x"], 2)
    ('ok', 3.0, 2.0)
    """
    columns = _check_task(task)
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    viz, html, progress = (check_bool(v, name) for v, name in ((viz, "viz"), (html, "html"), (progress, "progress")))
    if viz and out_dir is None:
        raise ValueError("viz=True needs out_dir: the pictures are written there")
    if html and out_dir is None:
        raise ValueError("html=True needs out_dir: the pages are written there")
    todo = [
        p if isinstance(p, Pair) else Pair(str(n), dict(zip(columns, map(str, p), strict=True)))
        for n, p in enumerate(pairs, start=1)
    ]
    seen: dict[str, str] = {}
    for p in todo:  # ids name output files: the manifest's rule holds for any caller
        _check_unique(seen, _check_id(p.id, "pairs"), "pairs")
    order = [p.id for p in todo]
    results = None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        results = _Results(Path(out_dir) / RESULTS)
        for p in todo:
            if on_skip is not None and results.done(p.id):
                on_skip(p)
        todo = [p for p in todo if not results.done(p.id)]
    size = CHUNK[task]
    chunks = [todo[s : s + size] for s in range(0, len(todo), size)]
    if engine == "local":
        stream = _local(task, chunks, options, (viz, html), workers)
    else:
        stream = _ray(task, chunks, options, (viz, html), workers, ray_address)
    finished = False
    try:
        with progress_bar(progress, total=len(todo), unit="pair", desc=f"batch {task}") as bar:
            for records in stream:
                for record in records:
                    if results is not None:
                        if record["status"] == "ok":
                            _write_outputs(record, results.path.parent)
                        results.add(record)
                    else:
                        arrays = record.pop("_arrays", None)
                        record.pop("_picture", None)
                        record.pop("_page", None)
                        if arrays:
                            record["arrays"] = arrays
                    bar.update(1)
                    yield record
        finished = True
    finally:
        stream.close()  # stops the workers of an interrupted run
        if results is not None:
            results.close(order if finished else None)
            if html and finished:
                write_index(results.path.parent)


def read_results(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``out_dir``'s results.jsonl, in its order (a torn last line left out)."""
    path = Path(out_dir) / RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist: no batch has written results there")
    records = []
    with open(path, "rb") as fh:
        for line in fh:
            record = _parse(line)
            if record is not None:
                records.append(record)
    return records


def write_index(out_dir: str | os.PathLike[str], page: str | os.PathLike[str] | None = None) -> Path:
    """The index page of the batch in ``out_dir`` (default ``out_dir/index.html``): a row per
    pair of its results.jsonl, linking the pages written beside it."""
    target = Path(page) if page is not None else Path(out_dir) / INDEX
    records = read_results(out_dir)
    write_page(target, batch_page(records, out_dir, target.parent, title=f"densematch batch: {Path(out_dir).name}"))
    return target
