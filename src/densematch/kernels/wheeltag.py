"""The platform tag of a wheel that ships the C kernels: manylinux where the libraries need no
more than the manylinux policies allow, the build machine's own tag elsewhere.

Standard library only: setup.py runs this file by its path at ``bdist_wheel``, before densematch
or torch can be imported. A manylinux wheel (PEP 600) installs with pip on any Linux whose glibc
is at least the tag's; the libraries are read, not trusted: their ELF dynamic section names the
shared libraries they load (DT_NEEDED) and their version-needs section the glibc symbol versions
they call (as auditwheel reads them; auditwheel itself is not a build dependency here).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ALLOWED", "OLDEST", "needs", "platform_tag"]

# what every manylinux policy lets a wheel load from the system (PEP 600's core libraries)
ALLOWED = frozenset(
    {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libgcc_s.so.1", "ld-linux-x86-64.so.2"}
)
# the oldest manylinux policy auditwheel offers for new wheels on x86-64 and aarch64 (manylinux2014)
OLDEST = (2, 17)
_SHT_DYNAMIC, _SHT_VERNEED, _DT_NEEDED = 6, 0x6FFFFFFE, 1


def _string(data: bytes, table: int, offset: int) -> str:
    end = data.index(b"\0", table + offset)
    return data[table + offset : end].decode()


def needs(library: Path) -> tuple[set[str], set[tuple[int, int]]] | None:
    """The shared libraries ``library`` loads and the glibc versions (major, minor) it calls, or
    None where it is not a little-endian 64-bit ELF file (the only kind built here)."""
    data = Path(library).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    loaded: set[str] = set()
    versions: set[tuple[int, int]] = set()
    for _name, kind, _flags, _addr, offset, size, link, info in sections:
        strtab = sections[link][4] if link < len(sections) else 0
        if kind == _SHT_DYNAMIC:
            for at in range(offset, offset + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == _DT_NEEDED:
                    loaded.add(_string(data, strtab, value))
        elif kind == _SHT_VERNEED:
            at = offset
            for _ in range(info):  # sh_info: the number of Verneed entries
                _version, count, _file, aux, following = struct.unpack_from("<HHIII", data, at)
                entry = at + aux
                for _ in range(count):
                    _hash, _vflags, _other, name, step = struct.unpack_from("<IHHII", data, entry)
                    found = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", _string(data, strtab, name))
                    if found:
                        versions.add((int(found[1]), int(found[2])))
                    entry += step
                at += following
    return loaded, versions


def platform_tag(libraries: Iterable[Path], platform: str) -> str:
    """``platform`` (the build's own tag, e.g. linux_x86_64) made manylinux_X_Y_<arch> where
    every library loads only :data:`ALLOWED` libraries: X.Y the newest glibc version they
    call, at least :data:`OLDEST`. Unchanged anywhere else (another system, a library loading
    more, a file this cannot read)."""
    arch = platform.removeprefix("linux_")
    if not platform.startswith("linux_") or arch not in ("x86_64", "aarch64"):
        return platform
    newest = OLDEST
    for library in libraries:
        found = needs(library)
        if found is None or not found[0] <= ALLOWED:
            return platform
        newest = max(newest, *found[1])
    return f"manylinux_{newest[0]}_{newest[1]}_{arch}"
