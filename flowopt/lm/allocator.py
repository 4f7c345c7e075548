"""Handing memory that torch freed back to the operating system (glibc keeps it otherwise).

torch allocates CPU tensors with ``malloc``. glibc serves blocks below its mmap threshold from arenas (one
per allocating thread, up to eight per core), and raises that threshold up to 32 MiB each time a larger
block is freed, so after the first training step nearly every activation lives in an arena. Freeing it
returns nothing to the OS unless it sits at an arena's top: a finished training step keeps its
activations' pages resident, and a later phase that allocates from another thread's arena (the decode
thread scoring the finetuned program) cannot reuse them. :func:`release_freed_memory` (glibc's
``malloc_trim(0)``) gives every wholly free page of every arena back; the next allocation faults fresh
pages in, which costs far less than a training step. Elsewhere (musl, macOS, Windows) it does nothing.

Example:
    >>> release_freed_memory() in (True, False)
    True
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded into this process: its libc
    except (OSError, AttributeError):
        logger.debug("no malloc_trim in this process's C library: freed memory stays with the allocator")
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the C allocator's free pages to the OS; True if any were returned, False if none were or the
    C library cannot (not glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
