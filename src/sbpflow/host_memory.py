"""Freed host memory stays with the process between steps, as CUDA's caching allocator keeps device memory.

A training step allocates and frees the same activations every step. With its default settings glibc's malloc
hands large freed blocks back to the kernel: blocks above the mmap threshold are unmapped on free, and a heap
whose free top grows past the trim threshold is shrunk. The next step then takes a page fault on every 4 KiB
page of those blocks again, and the kernel zeroes each page. A one-rank GPT step (4 layers, width 256) took
about 5000 such faults per step on the CPU machine of ``docs/benchmarks.md``, at 3.5 µs each: 6% of the step,
charged to whichever kernel touched the page first (``aten::mm`` measured 14% slower than the same call in
torch eager, whose different order of frees happened to fault less).

:func:`keep_freed_host_memory` sets both thresholds once per process (``mallopt``):

* ``M_MMAP_THRESHOLD`` = 32 MiB (glibc's largest): blocks up to 32 MiB come from the heap and are reused;
* ``M_TRIM_THRESHOLD`` = 1 GiB: a heap keeps up to 1 GiB of freed top instead of returning it.

Memory freed by a step is therefore kept for the next one (the process's resident size stays at its peak,
as with a caching allocator), and a steady step takes almost no page faults. Both executors call it when
they prepare a plan, and eager mode on its first ``backward()``. Setting only one of the two would be worse
than neither: an explicit trim threshold also freezes glibc's mmap threshold at 128 KiB, and every larger
block would then be mapped afresh.

It is process-wide: torch code in the same process benefits too, which keeps the benchmarks that interleave
sbpflow and torch in one process fair. ``SBPFLOW_HOST_CACHE=0`` leaves malloc's defaults alone. Where the C
library is not glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

from .distributed import config

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (half its 64 MiB heap size)
TRIM_THRESHOLD = 1 << 30

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet; then whether glibc took both settings


def keep_freed_host_memory() -> bool:
    """Sets glibc's thresholds once per process (see the module docstring); True if malloc now keeps freed
    host memory. Later calls return the first call's answer."""
    global _applied
    if _applied is not None:  # every eager backward asks: no lock once answered
        return _applied
    with _lock:
        if _applied is None:
            _applied = _configure()
        return _applied


def freed_host_memory_kept() -> bool:
    """Whether :func:`keep_freed_host_memory` has run in this process and glibc took its settings."""
    return _applied is True


def _configure() -> bool:
    if not config().host_cache or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mmap first: if glibc refused it, a trim threshold alone would freeze the mmap threshold at 128 KiB
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
