"""Reading inputs and writing results; every file is written to a temporary name, then renamed."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = [
    "ARRAY_OUTPUTS",
    "FIGURE_OUTPUTS",
    "IMAGE_SUFFIXES",
    "PAGE_OUTPUTS",
    "atomic_write",
    "is_image",
    "load_array",
    "load_image",
    "save_arrays",
    "save_npy",
    "save_npz",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif", ".webp")
ARRAY_SUFFIXES = (".npy", ".pt", ".pth")
# what an output's extension may be: arrays (an .npz of all, or one array as .npy), pictures
ARRAY_OUTPUTS = (".npz", ".npy")
FIGURE_OUTPUTS = (".png", ".jpg", ".jpeg", ".pdf", ".svg")
PAGE_OUTPUTS = (".html", ".htm")


def is_image(path: str | os.PathLike[str]) -> bool:
    return Path(_archive_member(path)[0]).suffix.lower() in IMAGE_SUFFIXES


def _existing(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"{what} {str(p)!r} is not a file")
    return p


def _archive_member(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``file.npz:name`` split into the archive and the array's name (None: not given)."""
    text = os.fspath(path)
    head, sep, name = text.rpartition(":")
    if sep and head.lower().endswith(".npz") and name and "/" not in name:
        return head, name
    return text, None


def load_array(path: str | os.PathLike[str], what: str = "input") -> np.ndarray:
    """An array from .npy, .npz (``file.npz:name``, or the archive's only array) or .pt (one
    tensor saved with torch.save; nothing else is unpickled)."""
    source, member = _archive_member(path)
    p = _existing(source, what)
    suffix = p.suffix.lower()
    try:
        if suffix == ".npy":
            return _load_npy(p, what)
        if suffix == ".npz":
            return _load_npz(p, member, what)
        if suffix in (".pt", ".pth"):
            return _load_pt(p, what)
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile) as err:
        if isinstance(err, ValueError) and str(err).startswith(what):
            raise
        raise ValueError(f"{what} {str(p)!r} could not be read as an array: {err}") from None
    raise ValueError(f"{what} {str(p)!r} must be a .npy, .npz or .pt array, or an image ({', '.join(IMAGE_SUFFIXES)})")


def _load_pt(p: Path, what: str) -> np.ndarray:
    import pickle

    import torch

    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"{what} {str(p)!r} holds pickled Python objects, not one tensor; densematch reads only a tensor "
            "saved with torch.save(tensor, path) and never unpickles other objects"
        ) from None
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{what} {str(p)!r} must hold one tensor, got {type(obj).__name__}")
    return obj.detach().float().numpy() if obj.dtype == torch.bfloat16 else obj.detach().numpy()


def _load_npz(p: Path, member: str | None, what: str) -> np.ndarray:
    with np.load(p, allow_pickle=False) as archive:
        names = list(archive.files)
        if member is None:
            if len(names) != 1:
                raise ValueError(
                    f"{what} {str(p)!r} holds {len(names)} arrays ({', '.join(names) or 'none'}): name one, "
                    f"as '{p}:{names[0] if names else 'NAME'}'"
                )
            member = names[0]
        if member not in names:
            raise ValueError(f"{what} {str(p)!r} has no array {member!r}; it holds {', '.join(names) or 'none'}")
        return archive[member]


def _load_npy(p: Path, what: str) -> np.ndarray:
    """A .npy file, its header checked against the file's size before any data is read (a
    truncated file, or a header declaring more than the file holds, never allocates)."""
    with open(p, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            f.seek(0)
            kind = "a zip archive (.npz?)" if f.read(4) == b"PK\x03\x04" else "not a .npy file"
            raise ValueError(
                f"{what} {str(p)!r} could not be read as an array: it is {kind}; save one array with numpy.save"
            )
        f.seek(0)
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _fortran, dtype = read(f)
        if dtype.hasobject:
            raise ValueError(f"{what} {str(p)!r} holds Python objects; only numeric arrays are read")
        declared = math.prod(shape) * dtype.itemsize
        held = os.fstat(f.fileno()).st_size - f.tell()
        if declared != held:
            raise ValueError(
                f"{what} {str(p)!r} could not be read as an array: its header declares shape {shape} of "
                f"{dtype} ({declared} bytes) but the file holds {held} bytes of data (truncated or corrupt)"
            )
        f.seek(0)
        return np.load(f, allow_pickle=False)


def load_image(path: str | os.PathLike[str], what: str = "image", grey: bool = False) -> np.ndarray:
    """An image as float32 in [0, 1]: (H, W) when grey, else (H, W, 3). Needs Pillow."""
    p = _existing(path, what)
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as err:
        raise ImportError("reading images needs Pillow: pip install 'densematch[images]'") from err
    try:
        with Image.open(p) as img:
            img = img.convert("L" if grey else "RGB")
            return np.asarray(img, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{what} {str(p)!r} could not be read as an image: {err}") from None


def load_any(path: str | os.PathLike[str], what: str, grey: bool = False) -> np.ndarray:
    """An image (float in [0, 1]) or an array, by the file's suffix."""
    return load_image(path, what, grey) if is_image(path) else load_array(path, what)


def check_output(path: str | os.PathLike[str], what: str = "output", suffixes: Sequence[str] = ()) -> Path:
    """Check, before any work, that ``path`` can be written: its folder exists, it is not a
    folder itself, and (given ``suffixes``) its extension names a format written here."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"{what} {str(target)!r}: the folder {str(directory)!r} does not exist")
    if target.is_dir():
        raise ValueError(f"{what} {str(target)!r} is a folder; give a file name")
    if suffixes and target.suffix.lower() not in suffixes:
        raise ValueError(f"{what} {str(target)!r}: the extension chooses the format; use one of {', '.join(suffixes)}")
    return target


def save_arrays(path: str | os.PathLike[str], arrays: dict[str, np.ndarray], single: str) -> None:
    """Write by the extension: .npz, every array; .npy, the array named ``single`` alone."""
    suffix = check_output(path, suffixes=ARRAY_OUTPUTS).suffix.lower()
    if suffix == ".npy":
        save_npy(path, arrays[single])
    else:
        save_npz(path, **arrays)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[IO[bytes]]:
    """Open a temporary file beside `path`; rename it to `path` only if the block succeeds.

    The temporary file is created with mode 0666, so the process umask applies as to any new
    file, without reading the umask (setting it, even for a moment, races other threads)."""
    target = check_output(path)
    directory = target.parent if str(target.parent) else Path(".")
    while True:
        tmp = directory / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_npz(path: str | os.PathLike[str], **arrays: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.savez(f, allow_pickle=False, **arrays)


def save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.save(f, array)


def save_with(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Write through ``write(file)`` atomically (figures: ``lambda f: fig.savefig(f, format="png")``)."""
    with atomic_write(path) as f:
        write(f)
