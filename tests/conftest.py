"""Test configuration: JAX gets 8 CPU devices, set before any backend starts.

`JAX_LOSSSCALE_TEST_DEVICES` sets another number: tests/test_one_device.py runs the tests
of user steps again with one device, as most users train.
"""

import os
from collections.abc import Callable

import jax
import pytest

jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAX_LOSSSCALE_TEST_DEVICES", "8")))
jax.config.update("jax_platforms", "cpu")


@pytest.fixture(params=["jit", "nojit"])
def jit_or_eager(request) -> Callable:
    """Calls `fn(*args)` wrapped in `jax.jit`, or eagerly under `jax.disable_jit()`."""

    def call(fn, *args):
        if request.param == "jit":
            return jax.jit(fn)(*args)
        with jax.disable_jit():
            return fn(*args)

    return call
