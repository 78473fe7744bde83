"""Physical limits of the disk under the benchmark's work directory, for ``bench/spark_bench.py``:
raw sequential write throughput (``size`` bytes in 8 MiB blocks, then ``fsync``, timed together)
and sequential read throughput of the same file after dropping it from the page cache
(``os.posix_fadvise(POSIX_FADV_DONTNEED)`` after the fsync; the kernel may keep pages it cannot
drop, so the read figure is an upper bound when the drop is partial).

The snapshot write throughput (bytes a checkpoint writes / snapshot seconds) and the restore read
throughput (restored state bytes / restore seconds) are reported as fractions of these."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

BLOCK = 8 << 20


def probe(directory: Path, size: int = 512 << 20) -> dict[str, Any]:
    """Write then read ``size`` bytes under ``directory``; MiB/s of each (the file is removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"disk-probe-{os.getpid()}.bin"
    block = os.urandom(BLOCK)  # incompressible, in case the filesystem compresses
    blocks = max(1, size // BLOCK)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(blocks):
                os.write(fd, block)
            os.fsync(fd)
            write_s = time.perf_counter() - t0
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read = 0
            t0 = time.perf_counter()
            while chunk := os.read(fd, BLOCK):
                read += len(chunk)
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    written = blocks * BLOCK
    return {
        "directory": str(directory),
        "bytes": written,
        "block_bytes": BLOCK,
        "write_s": round(write_s, 3),
        "read_s": round(read_s, 3),
        "write_mib_s": round(written / write_s / 2**20, 1),
        "read_mib_s": round(read / read_s / 2**20, 1),
    }


def limits(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The best of the probes (start and end of the run): the disk's limit, the others' load
    being what makes a probe slower."""
    return {
        "write_mib_s": max(p["write_mib_s"] for p in probes),
        "read_mib_s": max(p["read_mib_s"] for p in probes),
        "probes": probes,
    }
