"""`loss_scaled` under distribution (docs/distributed.md): pmap, shard_map, SPMD jit, processes."""

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls
from jax_lossscale import _loss_scaled
from jax_lossscale._platforms import Form

import multiprocess_worker as worker  # tests/multiprocess_worker.py

NUM_DEVICES = 8
AXIS = "d"
LOSS_SCALE = jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2, multiplier=2.0)

# Per step: None, or (the device whose gradients overflow, the value it holds).
STEPS = [None, (3, np.inf), None, None, (0, np.nan), None, (7, -np.inf), None]
EXPECTED_SCALES = [1024.0, 512.0, 512.0, 1024.0, 512.0, 512.0, 256.0, 256.0]
EXPECTED_SKIPPED = [0, 1, 1, 1, 2, 2, 3, 3]
EXPECTED_NAN_SKIPPED = [0, 0, 0, 0, 1, 1, 1, 1]
EXPECTED_INF_SKIPPED = [0, 1, 1, 1, 1, 1, 2, 2]


def _tx(axis_name: str | None = None) -> optax.GradientTransformationExtraArgs:
    return jls.loss_scaled(optax.adam(0.125), LOSS_SCALE, axis_name=axis_name)


def _params(rows: int = 4) -> dict[str, np.ndarray]:
    w = (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) - 5.0) / 4.0
    return {"b": np.array([0.5, -1.0, 2.0], np.float32), "w": w}


def _grads(step: int, device: int, rows: int = 4) -> dict[str, np.ndarray]:
    """Integer-valued gradients, so that sums and means over 8 devices are exact."""
    rng = np.random.default_rng(100 * step + device)
    return {
        "b": rng.integers(-4, 5, size=3).astype(np.float32),
        "w": rng.integers(-4, 5, size=(rows, 3)).astype(np.float32),
    }


def _device_grads(step: int, mode: str) -> list[dict[str, np.ndarray]]:
    """Each device's unscaled gradients at `step`: the same on all, or its own for pmean."""
    grads = [_grads(step, d if mode == "pmean" else 0) for d in range(NUM_DEVICES)]
    if STEPS[step] is not None:
        device, value = STEPS[step]
        grads[device]["w"][1, 2] = value
    return grads


def _train_step(tx, params, opt_state, grads, mean_axis: str | None = None):
    """One step on the gradients of a scaled loss; `mean_axis` pmeans them first."""
    scale = jls.get_loss_scale(opt_state)
    scaled_grads = jax.tree.map(lambda g: g * scale, grads)
    if mean_axis is not None:
        scaled_grads = jax.lax.pmean(scaled_grads, mean_axis)
    updates, opt_state = tx.update(scaled_grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, updates


def _stack(trees):
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(x) for x in leaves]), *trees)


def _replicate(tree):
    return _stack([tree] * NUM_DEVICES)


def _on_device(host_tree, device: int):
    return jax.tree.map(lambda x: x[device], host_tree)


def _pmap_runner(mode: str, axis_name: str | None = AXIS):
    tx = _tx(axis_name)
    mean_axis = AXIS if mode == "pmean" else None
    return jax.pmap(lambda p, s, g: _train_step(tx, p, s, g, mean_axis), axis_name=AXIS), tx


def _shard_map_runner(mode: str, axis_name: str | None = AXIS, check_vma: bool = True):
    """A shard_map step taking and returning per-device trees stacked on a leading axis.

    Inside, each device holds its own params and state (sharded over the mesh), or, for
    "pmean", the data-parallel layout: params and state replicated, gradients pmean'ed.
    """
    tx = _tx(axis_name)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    sharded, replicated = PartitionSpec(AXIS), PartitionSpec()
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731

    if mode == "pmean":

        def per_device(params, opt_state, grads):
            return _train_step(tx, params, opt_state, first(grads), mean_axis=AXIS)

        mapped = jax.jit(
            jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(replicated, replicated, sharded),
                out_specs=replicated,
                check_vma=check_vma,
            )
        )

        def step(params, opt_state, grads):
            out = mapped(first(params), first(opt_state), grads)
            return jax.tree.map(_device_copies, out)

        return step, tx

    def per_device(params, opt_state, grads):
        out = _train_step(tx, first(params), first(opt_state), first(grads))
        return jax.tree.map(lambda x: x[None], out)

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(sharded,) * 3, out_specs=sharded, check_vma=check_vma
    )
    return jax.jit(mapped), tx


def _device_copies(array: jax.Array) -> np.ndarray:
    """Each device's own copy of a replicated array, stacked in device order."""
    assert len(array.addressable_shards) == NUM_DEVICES
    shards = sorted(array.addressable_shards, key=lambda shard: shard.device.id)
    return np.stack([np.asarray(shard.data) for shard in shards])


def _shard_map_no_vma_check_runner(mode: str, axis_name: str | None = AXIS):
    return _shard_map_runner(mode, axis_name, check_vma=False)


RUNNERS = {
    "pmap": _pmap_runner,
    "shard_map": _shard_map_runner,
    "shard_map_no_vma_check": _shard_map_no_vma_check_runner,
}


@functools.cache
def _runner(name: str, mode: str, axis_name: str | None = AXIS):
    """The runner's step function and its tx, built once so that tests share compilations."""
    return RUNNERS[name](mode, axis_name)


@functools.cache
def _reference_step():
    tx = _tx()
    return jax.jit(lambda p, s, g: _train_step(tx, p, s, g))


@pytest.mark.parametrize("mode", ["identical", "pmean"])
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_devices_agree_and_match_single_device(runner, mode):
    step_fn, tx = _runner(runner, mode)
    reference_step = _reference_step()
    ref_params = _params()
    ref_state = tx.init(ref_params)
    params, opt_state = _replicate(ref_params), _replicate(ref_state)

    for step, overflow in enumerate(STEPS):
        device_grads = _device_grads(step, mode)
        if mode == "pmean":
            ref_grads = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *device_grads)
        else:
            ref_grads = device_grads[overflow[0] if overflow else 0]
        old_ref_params, old_ref_state = ref_params, ref_state
        ref_params, ref_state, ref_updates = reference_step(ref_params, ref_state, ref_grads)
        params, opt_state, updates = step_fn(params, opt_state, _stack(device_grads))

        expected_stats = jls.LossScaleStats(
            loss_scale=np.float32(EXPECTED_SCALES[step]),
            grad_norm=np.float32(_norm(ref_grads)),
            skipped_steps=np.int32(EXPECTED_SKIPPED[step]),
            nan_skipped_steps=np.int32(EXPECTED_NAN_SKIPPED[step]),
            inf_skipped_steps=np.int32(EXPECTED_INF_SKIPPED[step]),
            spike_skipped_steps=np.int32(0),
            consecutive_skipped_steps=np.int32(overflow is not None),
            last_step_applied=np.bool_(overflow is None),
        )
        chex.assert_trees_all_equal(jls.get_loss_scale_stats(ref_state), expected_stats)
        if overflow is None:
            assert not np.array_equal(ref_params["w"], old_ref_params["w"])
        else:
            chex.assert_trees_all_equal(ref_params, old_ref_params)
            chex.assert_trees_all_equal(ref_state.inner_state, old_ref_state.inner_state)
        outputs = jax.device_get((params, opt_state, updates))
        expected, expected_norm = _norm_apart((ref_params, ref_state, ref_updates))
        if runner == "shard_map" and mode == "identical":
            # The gradients vary over the axis as shard_map types them: 8 shards of one.
            expected_norm = expected_norm * np.sqrt(NUM_DEVICES)
        for device in range(NUM_DEVICES):
            on_device, norm = _norm_apart(_on_device(outputs, device))
            chex.assert_trees_all_equal(on_device, expected)
            np.testing.assert_allclose(norm, expected_norm, rtol=1e-6)


def _norm(grads) -> float:
    """The L2 norm of all the entries of `grads`, in float64: NaN for any NaN, +inf for an
    infinity and no NaN."""
    entries = np.concatenate([np.ravel(leaf).astype(np.float64) for leaf in jax.tree.leaves(grads)])
    return float(np.linalg.norm(entries))


def _norm_apart(outputs):
    """`(params, state, updates)` with the state's `grad_norm` zeroed, and that norm."""
    params, state, updates = outputs
    stats = state.stats._replace(grad_norm=np.zeros_like(state.stats.grad_norm))
    return (params, state._replace(stats=stats), updates), state.stats.grad_norm


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize(("device", "value"), [(0, np.nan), (5, np.inf), (7, -np.inf)])
def test_one_device_overflow_skips_every_device(runner, device, value):
    step_fn, tx = _runner(runner, "identical")
    params = _replicate(_params())
    opt_state = _replicate(tx.init(_params()))
    # One good step first, so that the inner state is not the initial one.
    params, opt_state, _ = step_fn(params, opt_state, _replicate(_grads(0, 0)))
    grads = [_grads(1, 0) for _ in range(NUM_DEVICES)]
    grads[device]["b"][0] = value

    new_params, new_state, updates = step_fn(params, opt_state, _stack(grads))

    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, opt_state.inner_state)
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.signbit(leaf), True)
    chex.assert_trees_all_equal(
        new_state.loss_scale_state,
        _replicate(
            jls.DynamicLossScaleState(
                loss_scale=np.float32(512.0),
                good_steps=np.int32(0),
                overflows_until_backoff=np.int32(1),
            )
        ),
    )
    chex.assert_trees_all_equal(
        jls.get_loss_scale_stats(new_state),  # read on each device's replica
        _replicate(_one_skip_stats(value)),
    )


def _one_skip_stats(value: float) -> jls.LossScaleStats:
    """Stats after one good step and then one skip for `value` (NaN or +-inf)."""
    is_nan = bool(np.isnan(value))
    return jls.LossScaleStats(
        loss_scale=np.float32(512.0),
        grad_norm=np.float32(np.nan if is_nan else np.inf),
        skipped_steps=np.int32(1),
        nan_skipped_steps=np.int32(is_nan),
        inf_skipped_steps=np.int32(not is_nan),
        spike_skipped_steps=np.int32(0),
        consecutive_skipped_steps=np.int32(1),
        last_step_applied=np.bool_(False),
    )


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_without_axis_name_devices_decide_alone(runner):
    """The reason for `axis_name`: without it only the overflowing device skips."""
    step_fn, tx = _runner(runner, "identical", axis_name=None)
    params = _replicate(_params())
    grads = [_grads(0, 0) for _ in range(NUM_DEVICES)]
    grads[2]["w"][0, 0] = np.inf

    _, new_state, _ = step_fn(params, _replicate(tx.init(_params())), _stack(grads))

    applied = np.asarray(new_state.stats.last_step_applied)
    np.testing.assert_array_equal(applied, [True, True, False, True, True, True, True, True])


@functools.cache
def _replicated_state_step():
    """A shard_map step on replicated params and state with per-device gradients.

    Adam's new state varies per device while the old one, kept on a skip, does not: the
    two branches of the library's `cond` must still agree on the type under check_vma.
    Results come out per device, stacked on a leading axis.
    """
    tx = _tx(AXIS)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))

    def per_device(params, opt_state, grads):
        out = _train_step(tx, params, opt_state, jax.tree.map(lambda g: g[0], grads))
        return jax.tree.map(lambda x: x[None], out)

    replicated, sharded = PartitionSpec(), PartitionSpec(AXIS)
    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(replicated, replicated, sharded), out_specs=sharded
    )
    return jax.jit(mapped), tx


def _trained_once(tx):
    """Params and state after one applied step, so that adam's moments are not zero."""
    params, opt_state, _ = _reference_step()(_params(), tx.init(_params()), _grads(0, 0))
    return jax.device_get((params, opt_state))


@pytest.mark.parametrize(("device", "value"), [(0, np.nan), (6, -np.inf)])
def test_shard_map_replicated_state_one_device_overflow_skips_all(device, value):
    step_fn, tx = _replicated_state_step()
    params, opt_state = _trained_once(tx)
    grads = [_grads(1, d) for d in range(NUM_DEVICES)]
    grads[device]["w"][2, 1] = value

    new_params, new_state, updates = jax.device_get(step_fn(params, opt_state, _stack(grads)))

    chex.assert_trees_all_equal(new_params, _replicate(params))
    chex.assert_trees_all_equal(new_state.inner_state, _replicate(opt_state.inner_state))
    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.signbit(leaf), True)
    chex.assert_trees_all_equal(
        (new_state.loss_scale_state, jls.get_loss_scale_stats(new_state)),
        _replicate(
            (
                jls.DynamicLossScaleState(np.float32(512.0), np.int32(0), np.int32(1)),
                _one_skip_stats(value),
            )
        ),
    )


def test_shard_map_replicated_state_all_finite_each_device_applies_its_own():
    step_fn, tx = _replicated_state_step()
    params, opt_state = _trained_once(tx)
    grads = [_grads(1, d) for d in range(NUM_DEVICES)]

    outputs = jax.device_get(step_fn(params, opt_state, _stack(grads)))

    # Each device's gradients vary over the axis: the norm is that of all of them.
    global_norm = np.float32(_norm(grads))
    for device in range(NUM_DEVICES):
        expected, own_norm = _norm_apart(_reference_step()(params, opt_state, grads[device]))
        on_device, norm = _norm_apart(_on_device(outputs, device))
        chex.assert_trees_all_equal(on_device, expected)
        np.testing.assert_allclose(norm, global_norm, rtol=1e-6)
        np.testing.assert_allclose(own_norm, _norm(grads[device]), rtol=1e-6)
        chex.assert_trees_all_equal(
            jls.get_loss_scale_stats(expected[1])._replace(grad_norm=None),
            jls.LossScaleStats(np.float32(2048.0), None, *[np.int32(0)] * 5, np.bool_(True)),
        )
    mu_w = outputs[1].inner_state[0].mu["w"]
    assert not np.array_equal(mu_w[0], mu_w[1])  # each device's state is its own


def _spmd_setup():
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    shardings = {
        "b": NamedSharding(mesh, PartitionSpec()),
        "w": NamedSharding(mesh, PartitionSpec(AXIS, None)),
    }
    return mesh, shardings


def _assert_sharded_like(tree, shardings):
    for name, sharding in shardings.items():
        leaf = tree[name]
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (name, leaf.sharding)


def test_spmd_jit_keeps_shardings_and_matches_unsharded_run():
    rows = 2 * NUM_DEVICES
    _, shardings = _spmd_setup()
    tx = _tx()
    step = jax.jit(lambda p, s, g: _train_step(tx, p, s, g))
    init = jax.jit(tx.init)
    one_device = jax.devices()[0]
    params = jax.device_put(_params(rows), shardings)
    opt_state = init(params)
    ref_params = jax.device_put(_params(rows), one_device)
    ref_state = init(ref_params)

    for i, overflow in enumerate(STEPS):
        grads = _grads(i, 0, rows)
        if overflow is not None:
            # Row 2 * d lies in the shard of device d.
            device, value = overflow
            grads["w"][2 * device, 1] = value
        old_params, old_state = params, opt_state
        params, opt_state, updates = step(params, opt_state, jax.device_put(grads, shardings))
        ref_params, ref_state, ref_updates = step(
            ref_params, ref_state, jax.device_put(grads, one_device)
        )

        adam_state = opt_state.inner_state[0]
        for tree in (params, updates, adam_state.mu, adam_state.nu):
            _assert_sharded_like(tree, shardings)
        for leaf in jax.tree.leaves(
            (adam_state.count, opt_state.loss_scale_state, opt_state.stats)
        ):
            assert leaf.sharding.is_fully_replicated
        chex.assert_trees_all_equal(
            (params, opt_state, updates), (ref_params, ref_state, ref_updates)
        )
        assert float(jls.get_loss_scale(opt_state)) == EXPECTED_SCALES[i]
        assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == EXPECTED_SKIPPED[i]
        if overflow is not None:
            chex.assert_trees_all_equal(params, old_params)
            chex.assert_trees_all_equal(opt_state.inner_state, old_state.inner_state)


EXPLICIT_INNERS = {
    "adam: a cond on a CPU": (lambda: optax.adam(0.125), Form.CPU),
    "adam: selects on a GPU": (lambda: optax.adam(0.125), Form.GPU),
    "sgd with momentum: selects": (lambda: optax.sgd(0.125, momentum=0.5), Form.LOWERED),
}


@pytest.mark.parametrize("inner", EXPLICIT_INNERS)
@pytest.mark.parametrize("entered", [False, True], ids=["placed", "under set_mesh"])
def test_spmd_jit_over_explicit_mesh_axes_keeps_shardings_and_matches_one_device(inner, entered):
    """`jax.make_mesh` makes `Explicit` axes, over which JAX types each operation with its
    operands' shardings: the skip's arrays of a leaf's shape (its selects' predicates, its
    -0.0 updates) are made with the leaf's sharding, where bare optax's step runs too. A
    donated step, traced once, matches one device bit for bit, skips keep params and state,
    and every leaf keeps its sharding."""
    make_inner, form = EXPLICIT_INNERS[inner]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    shardings = {
        "b": NamedSharding(mesh, PartitionSpec("model")),
        "w": NamedSharding(mesh, PartitionSpec("data", "model")),
    }
    tx = _loss_scaled.in_form(form, make_inner(), LOSS_SCALE)
    traces = []

    def step(params, opt_state, grads):
        traces.append(1)
        return _train_step(tx, params, opt_state, grads)

    sharded_step = jax.jit(step, donate_argnums=(0, 1))
    one_device_step = jax.jit(lambda p, s, g: _train_step(tx, p, s, g))
    params = {"b": np.array([0.5, -1.0, 2.0, 0.25], np.float32), "w": _params(8)["w"][:, :2]}
    with jax.sharding.set_mesh(mesh) if entered else contextlib.nullcontext():
        ref_params, ref_state = params, tx.init(params)
        params = jax.device_put(params, shardings)
        opt_state = tx.init(params)  # (jitted, bare optax's init too needs the mesh entered)
        for i, overflow in enumerate(STEPS):
            rng = np.random.default_rng(i)
            grads = {name: rng.integers(-4, 5, leaf.shape).astype(np.float32)
                     for name, leaf in ref_params.items()}  # fmt: skip
            if overflow is not None:
                grads["w"][overflow[0], 1] = overflow[1]
            old_params = jax.device_get(params)
            params, opt_state, updates = sharded_step(
                params, opt_state, jax.device_put(grads, shardings)
            )
            ref_params, ref_state, ref_updates = one_device_step(ref_params, ref_state, grads)
            for tree in (params, updates):
                _assert_sharded_like(tree, shardings)
            chex.assert_trees_all_equal(
                jax.device_get((params, opt_state, updates)), (ref_params, ref_state, ref_updates)
            )
            assert float(jls.get_loss_scale(opt_state)) == EXPECTED_SCALES[i]
            if overflow is not None:
                chex.assert_trees_all_equal(jax.device_get(params), old_params)
                for leaf in jax.tree.leaves(updates):
                    np.testing.assert_array_equal(np.signbit(leaf), True)
    assert len(traces) <= 2  # the step's scalars come back on the mesh once
    for leaf in jax.tree.leaves(opt_state.inner_state):
        if leaf.ndim:
            assert leaf.sharding.spec in (shardings["b"].spec, shardings["w"].spec)


def test_a_leaf_split_over_an_explicit_axis_of_one_device_is_checked_unreshaped():
    """`jax.make_mesh((8, 1), ...)`: a leaf whose spec names the axis of one device is split
    in its type, and JAX refuses to reshape it (the check's rows) without an output
    sharding; it is summed as a sharded leaf is, and the step is bare adam's."""
    mesh = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    params = {"w": jax.device_put(_params(8)["w"].T, sharding)}  # 3 x 8
    grads = {"w": jax.device_put(np.full((3, 8), 0.5, np.float32), sharding)}
    tx = _tx()
    with jax.sharding.set_mesh(mesh):
        scaled = jax.tree.map(lambda g: g * 1024.0, grads)
        updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)
        bare, _ = jax.jit(optax.adam(0.125).update)(grads, optax.adam(0.125).init(params), params)
    assert updates["w"].sharding.is_equivalent_to(sharding, 2)
    chex.assert_trees_all_equal(jax.device_get(updates), jax.device_get(bare))
    np.testing.assert_allclose(float(state.stats.grad_norm), np.sqrt(24 * 0.25), rtol=1e-6)


def test_count_non_finite_and_where_applied_over_explicit_mesh_axes():
    """`count_non_finite` of a leaf split over an explicit axis (which JAX refuses to
    flatten without an output sharding), and `where_applied` between batch statistics
    made replicated at init and new ones split over the axis, as plain JAX computes them."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    split = NamedSharding(mesh, PartitionSpec(None, "model"))
    grads = np.ones((4, 8), np.float32)
    grads[1, 2:5] = [np.inf, np.nan, -np.inf]
    counts = jls.count_non_finite({"w": jax.device_put(grads, split)})
    assert jls.non_finite_paths(counts) == {"w": 3}
    tx = jls.loss_scaled(optax.sgd(0.1), LOSS_SCALE)
    params = {"w": jax.device_put(np.ones((8, 16), np.float32), split)}
    stats = {"mean": jax.device_put(np.zeros(16, np.float32), NamedSharding(mesh, PartitionSpec()))}
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, PartitionSpec("data")))

    @jax.jit
    def step(params, stats, opt_state, x):
        new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * jnp.mean(x @ params["w"], axis=0)}
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jnp.sum(x @ p["w"]) * scale)(params)
        _, opt_state = tx.update(grads, opt_state, params)
        return jls.where_applied(opt_state, new_stats, stats)

    with jax.sharding.set_mesh(mesh):
        kept = step(params, stats, tx.init(params), x)
        skipped = step(params, stats, tx.init(params), x * np.inf)
    assert kept["mean"].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("model")), 1)
    np.testing.assert_array_equal(jax.device_get(kept["mean"]), np.full(16, 0.8, np.float32))
    np.testing.assert_array_equal(jax.device_get(skipped["mean"]), np.zeros(16, np.float32))


def test_an_eager_skip_over_explicit_mesh_axes_gives_sharded_negative_zeros():
    """Eagerly (as under `jax.disable_jit`), the skipped step's -0.0 updates are made on the
    devices and with the sharding of the updates the inner update would give."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))
    sharding = NamedSharding(mesh, PartitionSpec("model"))
    params = {"b": jax.device_put(np.arange(16, dtype=np.float32), sharding)}
    tx = _tx()
    opt_state = tx.init(params)
    grads = {"b": jax.device_put(np.full(16, np.nan, np.float32), sharding)}
    updates, new_state = tx.update(grads, opt_state, params)
    assert updates["b"].sharding.is_equivalent_to(sharding, 1)
    np.testing.assert_array_equal(np.signbit(jax.device_get(updates["b"])), True)
    chex.assert_trees_all_equal(
        jax.device_get(new_state.inner_state), jax.device_get(opt_state.inner_state)
    )
    assert float(jls.get_loss_scale(new_state)) == 512.0


def test_spmd_jit_does_not_gather_sharded_gradients():
    _, shardings = _spmd_setup()
    tx = _tx()
    params = jax.device_put(_params(2 * NUM_DEVICES), shardings)
    opt_state = jax.jit(tx.init)(params)
    grads = jax.device_put(_grads(0, 0, 2 * NUM_DEVICES), shardings)

    hlo = (
        jax.jit(lambda p, s, g: _train_step(tx, p, s, g))
        .lower(params, opt_state, grads)
        .compile()
        .as_text()
    )

    assert "all-gather" not in hlo
    assert "all-to-all" not in hlo
    assert "all-reduce" in hlo  # the finite flag, combined over the shards


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path: Path, num_processes: int, timeout_s: float) -> list[dict]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    script = Path(worker.__file__)
    procs, logs = [], []
    try:
        for i in range(num_processes):
            log = tmp_path / f"worker{i}.log"
            logs.append(log)
            with open(log, "w") as f:
                cmd = [sys.executable, str(script), "--process-id", str(i)]
                cmd += ["--num-processes", str(num_processes), "--port", str(port)]
                cmd += ["--output", str(tmp_path / f"worker{i}.json")]
                procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if codes != [0] * num_processes:
        output = "\n".join(
            f"--- worker {i} (exit {c}):\n{logs[i].read_text()}" for i, c in enumerate(codes)
        )
        pytest.fail(
            f"workers did not all finish within {timeout_s} s with exit code 0 "
            f"(negative: killed by signal)\n{output}"
        )
    return [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(num_processes)]


def _reference_run() -> tuple[list[bool], dict[str, np.ndarray], float]:
    """The workers' training on one device of this process, and its last gradient norm."""
    tx = worker.make_tx()
    step = worker.make_train_step(tx)
    params = jax.device_put(worker.init_params(), jax.devices()[0])
    opt_state = tx.init(params)
    applied = []
    for i in range(worker.NUM_STEPS):
        params, opt_state, _ = step(params, opt_state, worker.reference_batch(i, 2))
        applied.append(bool(jls.get_loss_scale_stats(opt_state).last_step_applied))
    return applied, params, float(jls.get_loss_scale_stats(opt_state).grad_norm)


def test_processes_agree_with_an_overflow_in_one_process(tmp_path):
    results = _run_workers(tmp_path, num_processes=2, timeout_s=120)

    expected_applied = [True, False, True, True, False, True]
    ref_applied, ref_params, ref_norm = _reference_run()
    assert ref_applied == expected_applied
    for i, result in enumerate(results):
        assert (result["process_id"], result["process_count"]) == (i, 2)
        assert (result["global_devices"], result["local_devices"]) == (4, 2)
        assert result["applied"] == expected_applied
        # The overflow reached only the injecting process's own shards of `w`'s gradient.
        injecting = i == worker.INJECTING_PROCESS
        assert result["local_grads_finite"] == [
            {"b": True, "w": not (injecting and step in worker.OVERFLOW_STEPS)}
            for step in range(worker.NUM_STEPS)
        ]
        assert result["scales"] == [1024.0, 512.0, 512.0, 1024.0, 512.0, 512.0]
        assert result["loss_scale_state"] == {
            "loss_scale": 512.0,
            "good_steps": 1,
            "overflows_until_backoff": 1,
        }
        # The global norm, over the shards of both processes.
        np.testing.assert_allclose(result["stats"].pop("grad_norm"), ref_norm, rtol=1e-6)
        assert ref_norm > 0
        assert result["stats"] == {
            "loss_scale": 512.0,
            "skipped_steps": 2,
            "nan_skipped_steps": 1,
            "inf_skipped_steps": 1,
            "spike_skipped_steps": 0,
            "consecutive_skipped_steps": 0,
            "last_step_applied": True,
        }
        assert all(result["shardings_kept"].values()), result["shardings_kept"]
        for name, value in ref_params.items():
            np.testing.assert_array_equal(
                np.asarray(result["params"][name], np.float32), value, err_msg=name, strict=True
            )
    # The other process skipped although every gradient it held was finite.
    other = results[1 - worker.INJECTING_PROCESS]
    for step in worker.OVERFLOW_STEPS:
        assert other["local_grads_finite"][step] == {"b": True, "w": True}
        assert other["applied"][step] is False
    assert results[0]["local_b"] == results[1]["local_b"]
    assert results[0]["params_sha256"] == results[1]["params_sha256"]


@pytest.mark.parametrize("average_in_float32", [False, True])
def test_a_float16_mean_of_scaled_gradients_overflows_where_a_float32_one_does_not(
    average_in_float32,
):
    """Two devices' finite scaled float16 gradients of 40960 sum to inf before the division."""
    tx = jls.loss_scaled(optax.sgd(2.0**-4), jls.DynamicLossScale(2.0**15), axis_name="data")
    devices = jax.local_devices()[:2]
    params = {"w": jnp.ones((2, 4), jnp.float16)}

    @functools.partial(jax.pmap, axis_name="data", devices=devices)
    def train_step(params, opt_state, x):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jnp.sum(x * p["w"]).astype(jnp.float32) * scale)(params)
        if average_in_float32:
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.pmap(tx.init, devices=devices)(params)
    x = jnp.full((2, 4), 1.25, jnp.float16)  # scaled by 2**15: 40960 on each device
    params, opt_state = train_step(params, opt_state, x)
    stats = jls.get_loss_scale_stats(opt_state)
    if average_in_float32:
        assert stats.skipped_steps.tolist() == [0, 0]
        np.testing.assert_array_equal(params["w"], np.full((2, 4), 1 - 1.25 / 16, np.float16))
        assert stats.loss_scale.tolist() == [2.0**15] * 2
    else:
        assert stats.skipped_steps.tolist() == [1, 1]
        assert stats.inf_skipped_steps.tolist() == [1, 1]
        np.testing.assert_array_equal(params["w"], np.ones((2, 4), np.float16))
        assert stats.loss_scale.tolist() == [2.0**14] * 2


def test_a_loss_varying_over_one_axis_of_a_two_axis_mesh_is_averaged_over_it():
    """`shard_map` over ("data", "model") with `axis_name=("data", "model")` and
    `skip_spike_sigmas`: the loss passed as `value=` varies over "data" only, as a
    data-parallel loss does. Its mean is taken over "data" (the global mean, 1.20703125,
    enters every device's window) and the step is the single-device step."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    tx = jls.loss_scaled(
        optax.sgd(0.1),
        jls.DynamicLossScale(2.0**4),
        axis_name=("data", "model"),
        skip_spike_sigmas=3.0,
        spike_window=4,
    )
    params = {"w": jnp.ones((2, 2))}
    x = jnp.arange(16.0).reshape(8, 2) / 16

    def loss_fn(params, x):
        return jnp.mean((x @ params["w"]) ** 2)

    def step(params, opt_state, x):
        scale = jls.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x) * scale)(params)
        # The params are replicated: their gradient comes summed over "data" (4 shards).
        grads = jax.tree.map(lambda g: g / 4, grads)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss / scale)
        return optax.apply_updates(params, updates), opt_state

    replicated = PartitionSpec()
    mapped = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(replicated, replicated, PartitionSpec("data")),
            out_specs=(replicated, replicated),
        )
    )
    new_params, opt_state = mapped(params, tx.init(params), x)

    losses = opt_state.spike_windows.recent_losses
    assert (float(losses.values[0]), int(losses.filled)) == (1.20703125, 1)
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 0
    expected = optax.apply_updates(
        params, jax.tree.map(lambda g: -0.1 * g, jax.grad(loss_fn)(params, x))
    )
    chex.assert_trees_all_close(new_params, expected, rtol=1e-6)
