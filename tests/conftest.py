"""Session-scoped fixtures shared by the whole suite."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Four virtual CPU devices for the tensor-parallel tests (tests/test_tensor_parallel.py); set before
# jax starts its backend. Measured on 2 cores: the other tests run no slower with them.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest  # noqa: E402

from tests.hf_fixtures import make_hf_checkpoint  # noqa: E402

# The suite's persistent compilation cache: a fresh directory per run, never the user's cache.
os.environ["JAXSPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxspec-test-xla-cache-")


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """Factory: hf_checkpoint(kind, **options) -> directory of a tiny random HF checkpoint
    (tests/hf_fixtures.make_hf_checkpoint), built once per (kind, options) for the session.
    Treat the directory as read-only; copy it before modifying."""
    cache: dict[str, Path] = {}

    def get(kind: str, **options: Any) -> Path:
        key = json.dumps([kind, options], sort_keys=True)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"hf_{kind}")
            cache[key] = make_hf_checkpoint(kind, directory, **options)
        return cache[key]

    return get
