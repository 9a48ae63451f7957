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
import sys
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


# The files whose tests take longest (`pytest --durations=0`, summed per file), first. With
# `--dist loadfile --no-loadscope-reorder` pytest-xdist hands each worker one file at a time, in
# collection order (by default it would hand out the files with the most tests first), so a long
# file handed out last keeps one worker busy while the other has nothing left: first, the long
# files spread over the workers and the short ones (those of 5 s and less) fill in at the end.
# Order only.
LONGEST_FILES = (
    "test_docs.py",
    "test_benchmarks.py",
    "test_integrations.py",
    "test_fp8_meta.py",
    "test_resnet_benchmark.py",
    "test_loss_scaled.py",
    "test_lowering.py",
    "test_spikes.py",
    "test_value_and_grad.py",
    "test_rl.py",
    "test_bf16_weights.py",
    "test_low_precision_state.py",
    "test_train_steps.py",
    "test_numerics.py",
    "test_distributed.py",
    "test_checkpoint.py",
    "test_demo.py",
    "test_gpu_program.py",
    "test_reliability.py",
    "test_migrating.py",
    "test_soak.py",
    "test_properties.py",
    "test_skip.py",
    "test_dynamic.py",
    "test_diagnostics.py",
    "test_platforms.py",
    "test_site.py",
    "test_model_state.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as found


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if config.stash.get(OWNS_CACHE, False):
        shutil.rmtree(os.environ.pop(CACHE_VARIABLE), ignore_errors=True)
    if hasattr(config, "workerinput"):
        # A pytest-xdist worker has sent its results (at the end of its session). Tearing down
        # its interpreter, with thousands of compiled programs alive, takes seconds the run
        # waits for (8 s of a full run): the worker leaves at once instead.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@pytest.fixture(params=JIT_MODES)
def jit_or_eager(request) -> Callable:
    """Calls `fn(*args)` wrapped in `jax.jit`, or eagerly under `jax.disable_jit()`.

    Only for code whose path depends on whether values are concrete: `loss_scaled`'s skip
    (a Python branch instead of a `cond`), checks that refuse a traced value, the form of
    the finite check read from an array's sharding. Elsewhere the library runs the same
    operations either way, and a test calls `helpers.jitted` once.
    """
    return functools.partial(call_in_mode, request.param)
