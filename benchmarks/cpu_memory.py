"""Host memory on CPU benchmarks: glibc malloc set up to behave like a GPU caching allocator for
timing, and the peak-resident-set rise of one step for memory (see benchmarks/layer_cpu.py's
docstring for why each setting is needed)."""

from __future__ import annotations

import ctypes
from typing import Callable


def _rss(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (glibc malloc.h)
HEAP_RESERVE = 1 << 30  # heap pre-faulted for timed runs (layers' step working sets are well under it)


def malloc_for(timing: bool) -> None:
    """glibc malloc for timing (freed buffers stay in the heap and are reused, as in a GPU's
    caching allocator) or for memory measurement (every tensor buffer is its own mapping, returned
    to the OS when freed; glibc's default trim threshold).

    For timing, :data:`HEAP_RESERVE` of heap is also faulted in once and freed (and, with the trim
    threshold above it, kept): a layer whose buffers fragment the heap differently from step to
    step would otherwise grow it into fresh pages now and then, and the first touch of a fresh page
    costs 2-12 us on a VM (an 11.8 MB gather took 25-43 ms instead of 1 ms, 2,880 page faults), a
    cost a GPU's caching allocator does not have once warm."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, (32 << 20) if timing else (64 << 10))
    libc.mallopt(_M_TRIM_THRESHOLD, (2 * HEAP_RESERVE) if timing else (128 << 10))
    if timing:
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        chunk = 16 << 20  # under the mmap threshold: carved from the heap
        blocks = [libc.malloc(chunk) for _ in range(HEAP_RESERVE // chunk)]
        for block in blocks:
            if block:
                ctypes.memset(block, 0, chunk)
        for block in blocks:
            libc.free(block)


def peak_rss_rise(fn: Callable[[], object]) -> int:
    """Bytes the process's peak resident set rises above its resident set while ``fn()`` runs."""
    malloc_for(timing=False)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand free heap pages back, or the step reuses them unseen
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss("VmRSS")
        fn()
        return _rss("VmHWM") - base
    finally:
        malloc_for(timing=True)
