"""Shared test setup: every test session gets its own empty DSPy disk cache and no global LM."""

from __future__ import annotations

import os
import tempfile

# Must happen before dspy is imported anywhere: dspy reads the cache folder at import time, and a
# cache shared with earlier runs would answer LM calls that a test expects to reach its engine.
os.environ.setdefault("DSPY_CACHEDIR", tempfile.mkdtemp(prefix="flowopt-test-dspy-cache-"))
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
