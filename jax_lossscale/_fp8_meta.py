"""fp8 meta state: the leaves whose "gradients" are their new values, kept out of the optimizer.

fp8 layers (flax linen's `fp8_ops.Fp8DotGeneralOp`, `Fp8Einsum`) keep their scales and
amax histories as variables whose cotangents are their next values. `loss_scaled` finds
those leaves here, hands the rest of the tree to the inner optimizer, and turns the new
values into updates that set them, or keep them on a skipped step; the output gradients'
histories and scales follow every change of the loss scale. `value_and_grad` finds them here
too, to leave them out of the multiplication by the rest of the scale.
"""

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale._checks import describe, path_name
from jax_lossscale._numerics import GradientSummary, exact_flags
from jax_lossscale._types import AxisName, PyTree

# flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT, the collection of flax's fp8 meta state
# (a test checks that the two agree; flax is not imported at run time).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"

# The names flax gives the meta state of the output gradient (in Fp8DotGeneralOp,
# Fp8DirectDotGeneralOp and Fp8Einsum alike): the amaxes of the gradients of the *scaled*
# loss, which follow the loss scale when it grows.
GRADIENT_SIDE_NAMES = frozenset({"output_grad_amax_history", "output_grad_scale"})


def follows_scale(path: tuple[Any, ...]) -> bool:
    """Whether the meta leaf at `path` holds amaxes of the scaled gradients (flax's names)."""
    key = path[-1] if path else None
    return isinstance(key, jax.tree_util.DictKey) and key.key in GRADIENT_SIDE_NAMES


def times_saturating(leaf: jax.Array, factor: jax.Array) -> jax.Array:
    """`leaf * factor` computed in float32 (or wider), in `leaf`'s dtype: a finite entry whose
    product the dtype cannot hold becomes its largest finite value (an inf stays inf), so
    that a history that follows a growth of the scale never holds an inf it did not have."""
    wide = jnp.promote_types(leaf.dtype, jnp.float32)
    product = leaf.astype(wide) * jnp.asarray(factor).astype(wide)
    largest = float(jnp.finfo(leaf.dtype).max)
    saturated = jnp.where(jnp.isfinite(leaf), jnp.clip(product, -largest, largest), product)
    return saturated.astype(leaf.dtype)


def _under_collection(path: tuple[Any, ...], leaf: Any) -> bool:
    """The default: a leaf under a dict key equal to flax's collection name."""
    del leaf
    return any(
        isinstance(key, jax.tree_util.DictKey) and key.key == OVERWRITE_WITH_GRADIENT
        for key in path
    )


class MetaLeaves:
    """Which leaves of the gradients (and params) are meta state, from `loss_scaled`'s
    `fp8_meta` argument: None for the default, a predicate `(path, leaf) -> bool`, or a
    pytree of bools (a mask), a prefix of the gradients' structure."""

    def __init__(self, fp8_meta: Any, caller: str = "loss_scaled") -> None:
        self._predicate: Callable[[tuple[Any, ...], Any], Any] | None = None
        self._mask: PyTree = None
        leaves = jax.tree.leaves(fp8_meta)
        is_mask = bool(leaves) and all(isinstance(leaf, bool | np.bool_) for leaf in leaves)
        if fp8_meta is None:
            self._predicate = _under_collection
        elif callable(fp8_meta) and not is_mask:  # (an equinox mask is a callable Module)
            self._predicate = fp8_meta
        else:
            if not is_mask:
                raise TypeError(
                    f"{caller}(fp8_meta={describe(fp8_meta)}): fp8_meta must be None (flax's "
                    f"'{OVERWRITE_WITH_GRADIENT}' collection), a predicate (path, leaf) -> bool, "
                    "or a pytree of bools (a mask) whose structure is a prefix of the gradients'"
                )
            self._mask = fp8_meta

    def flags(self, tree: PyTree, arg_name: str, caller: str) -> list[bool]:
        """Per leaf of `tree`, in `jax.tree.leaves` order, whether it is meta state; errors
        name `caller` (`"loss_scaled.init"`, `"loss_scaled.update"`, `"value_and_grad"`)."""
        if self._predicate is not None:
            flags = []
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                flag = self._predicate(path, leaf)
                if not isinstance(flag, bool | np.bool_):
                    raise TypeError(
                        f"{caller}: the fp8_meta predicate returned {describe(flag)} "
                        f"for the {arg_name} leaf at {path_name(path)}; it must return a "
                        "Python bool"
                    )
                flags.append(bool(flag))
            return flags
        try:
            spread = jax.tree.map(
                lambda flag, subtree: jax.tree.map(lambda _: bool(flag), subtree),
                self._mask,
                tree,
            )
        except ValueError as error:
            raise ValueError(
                f"{caller}: the fp8_meta mask has the structure "
                f"{jax.tree.structure(self._mask)}, which is not a prefix of the {arg_name}' "
                f"structure {jax.tree.structure(tree)}"
            ) from error
        return cast(list[bool], jax.tree.leaves(spread))

    def following(self, tree: PyTree, arg_name: str, caller: str) -> tuple[list[bool], list[bool]]:
        """Per leaf of `tree`: whether it is meta state, and whether it is meta state that
        holds amaxes of the scaled gradients (`follows_scale`)."""
        flags = self.flags(tree, arg_name, caller)
        paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        follows = [flag and follows_scale(path) for flag, path in zip(flags, paths, strict=True)]
        return flags, follows

    def without(self, params: PyTree) -> PyTree:
        """`params` with None in place of its meta leaves, for `inner.init`."""
        if params is None:
            return None
        leaves, structure = jax.tree.flatten(params)
        flags = self.flags(params, "params", "loss_scaled.init")
        kept = [None if flag else leaf for leaf, flag in zip(leaves, flags, strict=True)]
        return jax.tree.unflatten(structure, kept)

    def split(
        self, updates: PyTree, params: PyTree, axis_name: AxisName | None
    ) -> tuple[PyTree, PyTree, "MetaStep"]:
        """The gradients and params with None for their meta leaves, and the meta step."""
        with_paths, structure = jax.tree_util.tree_flatten_with_path(updates)
        leaves = [leaf for _, leaf in with_paths]
        flags = self.flags(updates, "gradients", "loss_scaled.update")
        if not any(flags):
            return updates, params, MetaStep()
        if params is None:
            raise ValueError(
                "loss_scaled.update: the gradients hold fp8 meta leaves, whose updates are "
                "their new values minus the old ones; pass params to update"
            )
        # jaxlib's PyTreeDef has no stubs: annotated, it is Any to mypy, and `!=` type-checks.
        params_structure: jax.tree_util.PyTreeDef = jax.tree.structure(params)
        if params_structure != structure:
            raise ValueError(
                f"loss_scaled.update: the gradients hold fp8 meta leaves, so params must have "
                f"their structure {structure}, but it has {params_structure}"
            )
        old_leaves = jax.tree.leaves(params)
        grads = jax.tree.unflatten(
            structure, [None if flag else leaf for leaf, flag in zip(leaves, flags, strict=True)]
        )
        kept_params = jax.tree.unflatten(
            structure,
            [None if flag else leaf for leaf, flag in zip(old_leaves, flags, strict=True)],
        )
        new = [leaf for leaf, flag in zip(leaves, flags, strict=True) if flag]
        old = [leaf for leaf, flag in zip(old_leaves, flags, strict=True) if flag]
        follows = [
            follows_scale(path) for (path, _), flag in zip(with_paths, flags, strict=True) if flag
        ]
        return grads, kept_params, MetaStep(structure, flags, new, old, axis_name, follows)


class MetaStep:
    """One step's meta leaves: their new values (combined over `axis_name` by max), the
    old ones, and whether the new ones are finite. Built with no arguments, a step whose
    gradients hold none: every method then gives back what it is given."""

    def __init__(
        self,
        structure: Any = None,
        flags: list[bool] | None = None,
        new: list[jax.Array] | None = None,
        old: list[jax.Array] | None = None,
        axis_name: AxisName | None = None,
        follows: list[bool] | None = None,
    ) -> None:
        self._structure = structure
        self._flags = flags or []
        self._local = new or []
        self._old = old or []
        self._follows = follows or []
        self.finite: jax.Array | None = None
        self.has_nan: jax.Array | None = None
        if not self._local:
            self._new: list[jax.Array] = []
            return
        # Exact per entry: a history may hold amaxes up to the float32 maximum.
        self.finite, self.has_nan = exact_flags(self._local, axis_name)
        if axis_name is not None:
            self._new = [jax.lax.pmax(leaf, axis_name) for leaf in self._local]
        else:
            self._new = list(self._local)

    def joined(self, summary: GradientSummary) -> GradientSummary:
        """The summary of the gradients, with the meta values' finiteness and NaNs added."""
        if self.finite is None or self.has_nan is None:
            return summary
        return summary._replace(
            finite=summary.finite & self.finite, has_nan=summary.has_nan | self.has_nan
        )

    def gated(self, apply: jax.Array) -> jax.Array:
        """`apply`, false where a new meta value is not finite, under every loss scale."""
        return apply if self.finite is None else apply & self.finite

    def merged(
        self, updates: PyTree, apply: jax.Array, scale_ratio: Callable[[], jax.Array]
    ) -> PyTree:
        """The inner updates with, at the meta leaves, the updates that set them.

        An applied step sets each meta leaf to its new value, a skipped one keeps it, bit for
        bit, except the output gradients' amax histories and scales: they hold amaxes of the
        *scaled* gradients, so on every step, applied or skipped, they are multiplied by
        `scale_ratio()` (the new loss scale over the old, read only where there are meta
        leaves), a growth and a back-off alike, saturating at the dtype's largest value
        (`times_saturating`). The update of a floating leaf is computed and returned in
        float32 (or the leaf's dtype where wider): `optax.apply_updates` then adds it in
        float32, where `new - old` of two bfloat16 or float16 values is exact (within 2**16,
        2**13 of each other), and the sum is `new` exactly.
        """
        if not self._local:
            return updates
        ratio = scale_ratio()
        moved = ratio != 1

        def meta_update(new: jax.Array, old: jax.Array, follows: bool) -> jax.Array:
            if not jnp.issubdtype(old.dtype, jnp.floating):
                return jnp.where(apply, new - old, jnp.zeros_like(old))
            target = jnp.where(apply, new.astype(old.dtype), old)
            changes = apply
            if follows:
                target = times_saturating(target, ratio)
                changes = apply | moved
            wide = jnp.promote_types(old.dtype, jnp.float32)
            update = target.astype(wide) - old.astype(wide)
            return jnp.where(changes, update, jnp.full_like(update, -0.0))

        inner_leaves = iter(jax.tree.leaves(updates))
        meta_updates = iter(
            meta_update(new, old, follows)
            for new, old, follows in zip(self._new, self._old, self._follows, strict=True)
        )
        leaves = [next(meta_updates) if flag else next(inner_leaves) for flag in self._flags]
        return jax.tree.unflatten(self._structure, leaves)
