"""The process's memory allocator, set for XLA's CPU runtime.

XLA's CPU runtime allocates every computation's buffers afresh and frees them when it ends. glibc's
malloc hands a large block back to the operating system when it is freed (blocks above its mmap
threshold, the heaps of the per-thread arenas when they empty, the top of the heap past the trim
threshold), so the next computation's first write to every page of its buffers is a page fault and
a page the kernel zeroes. Kept in one arena and never returned, the freed memory is reused as it
is. What is computed is unchanged; the resident memory is the peak of the buffers alive at once."""

import ctypes
import sys

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
NEVER_TRIM = 2**31 - 1
"""The largest trim threshold mallopt takes: a free top of the heap this large is kept."""


def keep_freed_memory():
    """Every thread allocates from the main heap, large blocks included, and freed memory stays
    in the process. Call it before the threads start (an arena, once a thread's, stays its own).
    Only glibc's malloc has these settings; elsewhere (macOS, musl) this does nothing."""
    if not sys.platform.startswith("linux"):
        return
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return
    mallopt(M_ARENA_MAX, 1)
    mallopt(M_MMAP_MAX, 0)
    mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
