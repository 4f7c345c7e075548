"""Shared test setup: every test session gets its own empty DSPy disk cache and no global LM."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Must happen before dspy is imported anywhere: dspy reads the cache folder at import time, and a
# cache shared with earlier runs would answer LM calls that a test expects to reach its engine.
if "DSPY_CACHEDIR" not in os.environ:
    os.environ["DSPY_CACHEDIR"] = tempfile.mkdtemp(prefix="flowopt-test-dspy-cache-")
    # Removed when this process ends (each xdist worker makes its own), so runs leave no cache in /tmp.
    atexit.register(shutil.rmtree, os.environ["DSPY_CACHEDIR"], ignore_errors=True)
os.environ.setdefault("FLOWOPT_CACHE_DIR", os.path.expanduser("~/.cache/flowopt"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import dspy
import pytest


@pytest.fixture(autouse=True)
def _fresh_dspy_settings():
    """Each test starts without a configured LM and with an empty in-memory cache."""
    dspy.configure(lm=None, adapter=None)
    dspy.cache.reset_memory_cache()
    yield
    dspy.configure(lm=None, adapter=None)
