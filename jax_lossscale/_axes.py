"""Where a value lives: the `shard_map` axes it varies over, and whether XLA may split it."""

from typing import Any, cast

import jax
from jax.sharding import AxisType, NamedSharding


def varying_axes(value: Any) -> frozenset[Any]:
    """The `shard_map` axes over which `value` varies: a shard of a sharded leaf, or a value
    computed from one (none outside `shard_map`, and none under `pmap` or `check_vma=False`,
    where nothing says)."""
    axis_type = getattr(jax.typeof(value), "manual_axis_type", None)
    return cast(frozenset[Any], getattr(axis_type, "varying", frozenset()))


def varying_like(value: jax.Array, like: Any) -> jax.Array:
    """`value`, made to vary over the `shard_map` axes `like` (a value or its type) varies over
    too: a state that comes in replicated comes out of an update varying when the gradients
    vary per device, and the two branches of a skip must agree on it."""
    missing = _varying_of(like) - varying_axes(value)
    if not missing:
        return value
    varying: jax.Array = jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")
    return varying


def _varying_of(like: Any) -> frozenset[Any]:
    if isinstance(like, jax.ShapeDtypeStruct | jax.core.AbstractValue):
        axis_type = getattr(like, "manual_axis_type", None)
        return cast(frozenset[Any], getattr(axis_type, "varying", frozenset()))
    return varying_axes(like)


def may_be_sharded(leaf: Any) -> bool:
    """Whether XLA may split `leaf` over more than one device, as its type says, or its type
    says it is split.

    The type of an array (`jax.typeof(leaf).sharding`) names the mesh it is placed on, or
    none for an array on one device and for a NumPy array; then the mesh entered with
    `jax.sharding.set_mesh`, if any, is read instead. An `Explicit` axis splits the leaf
    where its spec names the axis (in its type even over one device, where JAX refuses to
    reshape it without an output sharding), an `Auto` axis (of a `Mesh` built directly) of
    more than one device lets XLA's partitioner split it as it chooses, and a `Manual` axis
    (inside `pmap` or `shard_map`) holds each device's own values, which are not split.
    Nothing here reads how many devices the process has: a leaf on one device of eight is
    not sharded. Under `jit` given `in_shardings` alone, the type of an argument names no
    mesh; the leaf is then taken as unsharded, which stays correct if XLA splits it after
    all (the partitioner then gathers the small per-device results).
    """
    sharding = jax.typeof(leaf).sharding
    mesh = sharding.mesh
    split: set[Any] = set()
    if mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    else:
        split = _named_axes(sharding.spec)
    for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True):
        if (kind == AxisType.Auto and size > 1) or (kind == AxisType.Explicit and name in split):
            return True
    return False


def explicit_sharding(like: Any) -> Any:
    """The sharding of `like` (a value or its type) where its spec names an `Explicit` mesh
    axis, else None. JAX types an operation's operands alike over explicit axes, so an array
    made to stand beside such a value (a select's predicate, a skipped step's -0.0 updates)
    is made with this sharding."""
    if isinstance(like, jax.ShapeDtypeStruct | jax.core.AbstractValue):
        sharding = getattr(like, "sharding", None)
    else:
        sharding = jax.typeof(like).sharding
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or mesh.empty:
        return None
    split = _named_axes(spec)
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True):
        if kind == AxisType.Explicit and name in split:
            return sharding
    return None


def on_meshes_of(arrays: Any, types: Any) -> Any:
    """`types` (of `jax.eval_shape`, traced from `arrays`) with each explicit sharding on the
    devices of the mesh of `arrays` that it names: outside a trace an array cannot be made on
    an abstract mesh, which is all that `jax.eval_shape` gives."""
    meshes = {
        leaf.sharding.mesh.abstract_mesh: leaf.sharding.mesh
        for leaf in jax.tree.leaves(arrays)
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding)
    }

    def on_devices(type_: Any) -> Any:
        sharding = explicit_sharding(type_)
        if sharding is None or sharding.mesh not in meshes:
            return type_
        return type_.update(sharding=NamedSharding(meshes[sharding.mesh], sharding.spec))

    return jax.tree.map(on_devices, types)


def _named_axes(spec: Any) -> set[Any]:
    """The mesh axes a `PartitionSpec` names."""
    named: set[Any] = set()
    for entry in spec:
        if entry is not None:
            named.update(entry if isinstance(entry, tuple) else [entry])
    return named


def names_of(axis_name: Any) -> tuple[Any, ...]:
    """The axis names of an `axis_name` argument (a name or a tuple of them), () for None."""
    if axis_name is None:
        return ()
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)
