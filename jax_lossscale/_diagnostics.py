"""Overflow diagnostics: which gradient leaves hold NaN or inf, by pytree path."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._checks import INT32_MAX, check_array_leaves, describe, path_name
from jax_lossscale._numerics import is_floating
from jax_lossscale._types import PyTree


def count_non_finite(tree: PyTree) -> PyTree:
    """Counts the NaN, +inf and -inf entries of each leaf of `tree`.

    Works inside `jit`, so a train step can return it next to the loss, and
    `non_finite_paths` can name the layers that overflowed on the host. Leaves
    that are not floating (integer, boolean, float0) count 0; `None` stays `None`.

    Args:
      tree: a pytree of arrays, typically the (scaled or unscaled) gradients.

    Returns:
      A pytree of the same structure whose leaves are int32 scalar arrays. A count
      stops at 2**31 - 1, for leaves with more non-finite entries than that.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.array([1.0, jnp.inf, jnp.nan])}}
      >>> jls.count_non_finite(grads)
      {'dense': {'b': Array(0, dtype=int32), 'w': Array(2, dtype=int32)}}
    """
    check_array_leaves(tree, arg_name="tree", caller="count_non_finite")
    return _count_non_finite(tree)


@jax.jit
def _count_non_finite(tree: PyTree) -> PyTree:
    def count(leaf: jax.Array) -> jax.Array:
        if not is_floating(leaf):
            return jnp.zeros([], jnp.int32)
        return saturating_count(jnp.logical_not(jnp.isfinite(leaf)))

    return jax.tree.map(count, tree)


def saturating_count(flags: jax.Array, chunk: int = INT32_MAX) -> jax.Array:
    """The number of true entries of `flags`, an int32 that stops at 2**31 - 1.

    An array of at most `chunk` (2**31 - 1) entries is counted at once in int32. A
    larger one is counted chunk by chunk, the running total kept in uint32 (which
    holds 2**31 - 1 plus one chunk's count) and stopped at 2**31 - 1 after each chunk.
    """
    flags = flags.reshape(-1)
    if flags.size <= chunk:
        return flags.sum(dtype=jnp.int32)
    total = jnp.zeros([], jnp.uint32)
    for start in range(0, flags.size, chunk):
        part = flags[start : start + chunk].sum(dtype=jnp.uint32)
        total = jnp.minimum(total + part, np.uint32(INT32_MAX))
    return total.astype(jnp.int32)


def non_finite_paths(counts: PyTree) -> dict[str, int]:
    """Names the leaves with a non-zero count in the output of `count_non_finite`.

    Runs on the host: it fetches the counts from the device. Paths are written
    with `/` between keys, e.g. `"encoder/layers/0/kernel"`. Counts with a leading
    device axis, from `pmap(count_non_finite)`, are summed over the devices.

    Args:
      counts: the pytree returned by `count_non_finite`, possibly after `jit` or `pmap`.

    Returns:
      A dict from path to count, in the tree's leaf order; empty when all is finite.

    Example:
      >>> import jax.numpy as jnp
      >>> import jax_lossscale as jls
      >>> grads = {"dense": {"b": jnp.zeros(2), "w": jnp.array([1.0, jnp.inf, jnp.nan])}}
      >>> jls.non_finite_paths(jls.count_non_finite(grads))
      {'dense/w': 2}
    """
    found = {}
    for path, count in jax.tree_util.tree_flatten_with_path(jax.device_get(counts))[0]:
        if not np.issubdtype(np.asarray(count).dtype, np.integer):
            raise TypeError(
                f"non_finite_paths: counts leaf at {path_name(path)} is "
                f"{describe(count, limit=None)}; pass the tree returned by count_non_finite"
            )
        total = int(np.sum(count))
        if total:
            found[jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"] = total
    return found
