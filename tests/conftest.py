"""Test configuration: JAX gets 8 CPU devices, set before any backend starts.

A test whose arrays are on one of them checks gradients as a host with one device does: the
form of the check is read from where the arrays are (`_numerics.may_be_sharded`).

The workers of one run (pytest-xdist) share a compilation cache, removed at the end: a
program that takes XLA long to compile (a benchmark's GPT or ResNet step, built by more than
one test) is compiled once per run. Nothing outlives the run, so every run starts cold.
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


CACHE_VARIABLE = "JAX_LOSSSCALE_TEST_COMPILATION_CACHE"
OWNS_CACHE = pytest.StashKey[bool]()


def pytest_configure(config):
    # The first process of a run makes the folder; its workers (and its subprocesses) inherit it.
    config.stash[OWNS_CACHE] = CACHE_VARIABLE not in os.environ
    if config.stash[OWNS_CACHE]:
        os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jax_lossscale-tests-")
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VARIABLE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_unconfigure(config):
    if config.stash.get(OWNS_CACHE, False):
        shutil.rmtree(os.environ.pop(CACHE_VARIABLE), ignore_errors=True)


# The files that take longest, first: each worker takes a whole file (`--dist loadfile`), in
# collection order, so a long file collected last would leave the other workers idle.
LONGEST_FIRST = [
    "test_benchmarks.py", "test_integrations.py", "test_reliability.py", "test_fp8_meta.py",
    "test_numerics.py", "test_resnet_benchmark.py", "test_loss_scaled.py", "test_value_and_grad.py",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file and among the others is kept


@pytest.fixture(params=JIT_MODES)
def jit_or_eager(request) -> Callable:
    """Calls `fn(*args)` wrapped in `jax.jit`, or eagerly under `jax.disable_jit()`."""
    return functools.partial(call_in_mode, request.param)
