"""Test configuration: JAX gets 8 CPU devices, set before any backend starts.

A test whose arrays are on one of them checks gradients as a host with one device does: the
form of the check is read from where the arrays are (`_numerics.may_be_sharded`).
"""

from collections.abc import Callable

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
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
