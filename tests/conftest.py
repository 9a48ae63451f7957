"""Test configuration: JAX gets 8 CPU devices, set before any backend starts.

A test whose arrays are on one of them checks gradients as a host with one device does: the
form of the check is read from where the arrays are (`_numerics.may_be_sharded`).

The workers of one run (pytest-xdist) share a compilation cache, removed at the end: every
program, however quick to compile, is compiled once per run, whichever test or worker builds
it again (a benchmark's GPT or ResNet step; the same small step built by many tests, or run
op by op under `jax.disable_jit`). Nothing outlives the run, so every run starts cold.
"""

import functools
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import pytest

from helpers import JIT_MODES, call_in_mode

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
# Where the CUDA plugin is installed (the gpu-compile extra, for tests/test_gpu_program.py), it
# starts with JAX's backends, and without CUDA libraries it refuses to unless told not to check
# them; JAX's platform stays the CPU.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


CACHE_VARIABLE = "JAX_LOSSSCALE_TEST_COMPILATION_CACHE"
OWNS_CACHE = pytest.StashKey[bool]()


def pytest_configure(config):
    # The first process of a run makes the folder; its workers (and its subprocesses) inherit it.
    config.stash[OWNS_CACHE] = CACHE_VARIABLE not in os.environ
    if config.stash[OWNS_CACHE]:
        os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jax_lossscale-tests-")
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # 4:45 -> 4:34


def pytest_unconfigure(config):
    if config.stash.get(OWNS_CACHE, False):
        shutil.rmtree(os.environ.pop(CACHE_VARIABLE), ignore_errors=True)


@pytest.fixture(params=JIT_MODES)
def jit_or_eager(request) -> Callable:
    """Calls `fn(*args)` wrapped in `jax.jit`, or eagerly under `jax.disable_jit()`.

    Only for code whose path depends on whether values are concrete: `loss_scaled`'s skip
    (a Python branch instead of a `cond`), checks that refuse a traced value, the form of
    the finite check read from an array's sharding. Elsewhere the library runs the same
    operations either way, and a test calls `helpers.jitted` once.
    """
    return functools.partial(call_in_mode, request.param)
