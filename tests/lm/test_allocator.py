"""Freed tensor memory goes back to the OS when flowopt releases it (glibc keeps it otherwise)."""

from __future__ import annotations

import sys

import pytest
import torch

from flowopt.lm.allocator import release_freed_memory

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _is_glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _is_glibc(), reason="malloc_trim is glibc's")
def test_freed_tensors_in_the_arena_are_returned_to_the_os():
    """128 MiB of small tensors (64 KiB each, below any mmap threshold, so they come from the arena) are
    written and freed, all but the last (which pins the arena's top, as a live tensor does in training):
    the pages stay resident until release_freed_memory() hands them back."""
    tensors = [torch.ones(16 * 1024) for _ in range(2048)]  # 64 KiB of float32 each, pages touched
    pin = tensors[-1]
    del tensors
    held = _rss()
    assert release_freed_memory() is True
    released = _rss()
    assert held - released > 64 * MiB, f"RSS {held / MiB:.0f} MiB -> {released / MiB:.0f} MiB"
    assert float(pin.sum()) == 16 * 1024  # the live tensor is untouched
