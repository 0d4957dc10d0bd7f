"""Freed host memory stays with the process between steps, as CUDA's caching allocator keeps device memory.

With glibc's defaults, large freed blocks go back to the kernel, and the next step page-faults (and the
kernel zeroes) every page of them again: a measurable share of a CPU step (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

from .distributed import config

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# glibc unmaps blocks above the mmap threshold on free; at 32 MiB (glibc refuses more: half its 64 MiB heap
# size) they come from the heap and are reused
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # a heap keeps up to 1 GiB of freed top instead of returning it to the kernel

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet; then whether glibc took both settings


def keep_freed_host_memory() -> bool:
    """Sets glibc's thresholds once per process (``mallopt``); True if malloc now keeps freed host memory.
    Later calls return the first call's answer.

    The resident size then stays at its peak, as with a caching allocator, and a steady step takes almost no
    page faults. Both executors call it when they prepare a plan, and eager mode on its first ``backward()``.
    It is process-wide: torch code in the same process benefits too, which keeps the benchmarks that interleave
    sbpflow and torch fair. ``SBPFLOW_HOST_CACHE=0`` leaves malloc's defaults; without glibc it does nothing."""
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
