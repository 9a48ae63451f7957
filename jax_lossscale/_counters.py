"""Counters that stop at the largest int32 rather than wrap around."""

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)


def counted(count: jax.Array, flag: jax.Array) -> jax.Array:
    """The int32 `count`, plus one where `flag` is true, stopping at 2**31 - 1."""
    return count + (flag & (count < INT32_MAX)).astype(jnp.int32)


def count_true(flags: jax.Array, chunk: int = INT32_MAX) -> jax.Array:
    """The number of true entries of `flags`, an int32 that stops at 2**31 - 1.

    An array of at most `chunk` (2**31 - 1) entries is counted at once in int32. A larger
    one is counted chunk by chunk, the running total kept in uint32 (which holds 2**31 - 1
    plus one chunk's count) and stopped at 2**31 - 1 after each chunk.
    """
    if flags.size <= chunk:  # (unreshaped: a leaf split over an explicit mesh axis)
        return flags.sum(dtype=jnp.int32)
    flags = flags.reshape(-1)
    total = jnp.zeros([], jnp.uint32)
    for start in range(0, flags.size, chunk):
        part = flags[start : start + chunk].sum(dtype=jnp.uint32)
        total = jnp.minimum(total + part, np.uint32(INT32_MAX))
    return total.astype(jnp.int32)
