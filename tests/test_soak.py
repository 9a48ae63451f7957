"""Fault-injection soak of `loss_scaled` (docs/update-rule.md, docs/optax-wrapper.md,
docs/distributed.md).

Thousands of adamw steps inside `lax.scan`, with NaN, +inf and -inf written into
random single entries of the scaled gradients and a burst that pins the scale at its
floor. Checked: params stay finite, the scale follows a plain-Python model of 3.3
within [min, max], the skip statistics count the injected steps exactly, and the
final params and optimizer state match a bare adamw fed only the finite steps.

Scales are powers of two and gradients are float32 of moderate size, so dividing
`grad(loss * scale)` by the scale gives back `grad(loss)` exactly: the wrapped and
the clean run see the same gradients, and their params differ only where XLA
compiles the two programs differently (see `RTOL`).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import ReferenceLossScale

IN, HIDDEN, OUT = 24, 64, 8
MIN_SCALE, MAX_SCALE = 2.0**-4, 2.0**20
# The wrapped and the clean run apply the same gradients, but XLA compiles the two
# step functions differently (fusion, multiply-add contraction), so params drift
# apart by float32 rounding: up to about 6e-7 on params of size 1 after 2,400 steps.
# Leaving out a single finite step, or letting a skip decay adam's moments, moves
# them by more than 1e-3.
RTOL, ATOL = 1e-6, 2e-6
STATE_RTOL = 1e-5  # adam's moments, relative to each leaf's largest entry
STEPS = 2400
BURST = range(1200, 1240)
PMAP_STEPS = 400
PMAP_BURST = range(160, 200)
PER_DEVICE_BATCH = 4
NUM_DEVICES = 8
AXIS = "batch"
VALUES = np.array([0.0, np.nan, np.inf, -np.inf], np.float32)


def _init_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    return {
        "b1": np.zeros(HIDDEN, np.float32),
        "b2": np.zeros(OUT, np.float32),
        "gain": np.float32(1.0),
        "w1": (rng.randn(IN, HIDDEN) / np.sqrt(IN)).astype(np.float32),
        "w2": (rng.randn(HIDDEN, OUT) / np.sqrt(HIDDEN)).astype(np.float32),
    }


LEAF_SIZES = [np.size(leaf) for leaf in jax.tree.leaves(_init_params(0))]


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    prediction = params["gain"] * (hidden @ params["w2"] + params["b2"])
    return jnp.mean((prediction - y) ** 2)


def _data(steps: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fresh batch for every step, labelled by a fixed random teacher plus noise."""
    rng = np.random.RandomState(seed)
    teacher = rng.randn(IN, OUT).astype(np.float32) / np.sqrt(IN)
    x = rng.randn(steps, batch, IN).astype(np.float32)
    y = np.sin(x @ teacher) + 0.1 * rng.randn(steps, batch, OUT).astype(np.float32)
    return x, y.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per step: what to write into the scaled gradients (kind 0 writes nothing)."""

    kind: np.ndarray  # int: 0 none, 1 NaN, 2 +inf, 3 -inf
    leaf: np.ndarray  # int: index of the leaf in tree order, -1 when kind is 0
    pos: np.ndarray  # int: flat index into that leaf

    @property
    def value(self) -> np.ndarray:
        return VALUES[self.kind]

    @property
    def injected(self) -> np.ndarray:
        return self.kind > 0


def _schedule(steps: int, rate: float, burst: range, seed: int) -> Schedule:
    rng = np.random.RandomState(seed)
    injected = rng.random_sample(steps) < rate
    injected[burst.start : burst.stop] = True
    kind = np.where(injected, rng.randint(1, 4, steps), 0)
    leaf = np.where(injected, rng.randint(0, len(LEAF_SIZES), steps), -1)
    pos = rng.randint(0, 2**30, steps) % np.array(LEAF_SIZES)[leaf]
    return Schedule(kind, leaf, np.where(injected, pos, 0))


def _inject(tree, leaf, pos, value):
    """`tree` with `value` written at flat index `pos` of its `leaf`-th leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    hit_leaves = []
    for i, g in enumerate(leaves):
        hit = (leaf == i) & (jnp.arange(g.size) == pos).reshape(g.shape)
        hit_leaves.append(jnp.where(hit, value, g))
    return jax.tree.unflatten(treedef, hit_leaves)


def _all_finite(tree) -> jax.Array:
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(tree)]).all()


def _consecutive_skips(injected: np.ndarray) -> np.ndarray:
    runs, run = [], 0
    for skipped in injected:
        run = run + 1 if skipped else 0
        runs.append(run)
    return np.array(runs)


def _inner() -> optax.GradientTransformation:
    return optax.adamw(3e-3, weight_decay=1e-2)


def _loss_scale(hysteresis: int, consecutive: bool) -> jls.DynamicLossScale:
    return jls.DynamicLossScale(
        initial_loss_scale=2.0**10,
        increment_period=2,
        min_loss_scale=MIN_SCALE,
        max_loss_scale=MAX_SCALE,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
    )


@functools.partial(jax.jit, static_argnums=0)
def _soak(tx, params, x, y, leaf, pos, value):
    """Runs `tx` over all steps; returns the final carry and per-step stats and finiteness."""

    def step(carry, inputs):
        params, opt_state = carry
        x, y, leaf, pos, value = inputs
        scale = jls.get_loss_scale(opt_state)
        scaled_grads = jax.grad(lambda p: _loss(p, x, y) * scale)(params)
        scaled_grads = _inject(scaled_grads, leaf, pos, value)
        updates, opt_state = tx.update(scaled_grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (jls.get_loss_scale_stats(opt_state), _all_finite(params))

    return jax.lax.scan(step, (params, tx.init(params)), (x, y, leaf, pos, value))


@functools.partial(jax.jit, static_argnums=0)
def _clean(inner, params, x, y):
    """The bare optimizer over the given steps' true gradients."""

    def step(carry, inputs):
        params, opt_state = carry
        updates, opt_state = inner.update(jax.grad(_loss)(params, *inputs), opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    return jax.lax.scan(step, (params, inner.init(params)), (x, y))[0]


def _check_stats(stats, finite_flags, ls: jls.DynamicLossScale, schedule: Schedule, burst):
    """The per-step statistics against the schedule and the reference model of the update rule."""
    injected = schedule.injected
    assert np.asarray(finite_flags).all()

    scales = np.asarray(stats.loss_scale)
    np.testing.assert_array_equal(
        scales, np.array(ReferenceLossScale.of(ls).scales(~injected), np.float32)
    )
    assert scales.min() >= MIN_SCALE
    assert scales.max() <= MAX_SCALE
    assert (scales == MAX_SCALE).any()
    assert (scales[: burst.start] == MAX_SCALE).any()
    assert (scales[burst.start : burst.stop] == MIN_SCALE).any()
    # The burst holds the scale at the floor for its last steps, and it recovers after.
    np.testing.assert_array_equal(scales[burst.stop - 5 : burst.stop], MIN_SCALE)
    assert (scales[burst.stop :] == MAX_SCALE).any()

    kind = schedule.kind
    np.testing.assert_array_equal(stats.skipped_steps, np.cumsum(injected))
    np.testing.assert_array_equal(stats.nan_skipped_steps, np.cumsum(kind == 1))
    np.testing.assert_array_equal(stats.inf_skipped_steps, np.cumsum(kind >= 2))
    np.testing.assert_array_equal(stats.consecutive_skipped_steps, _consecutive_skips(injected))
    np.testing.assert_array_equal(stats.last_step_applied, ~injected)


def _assert_close(actual, expected, rel: float):
    """Each leaf within `rel` times the leaf's largest magnitude: float rounding, not more."""
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= rel * np.abs(b).max(), (a, b)


def _check_matches_clean(params, inner_state, clean, init, applied: int):
    """The wrapped run's params and inner state against the clean run over `applied` steps."""
    clean_params, clean_state = clean
    assert optax.tree_utils.tree_get(inner_state, "count") == applied
    assert optax.tree_utils.tree_get(clean_state, "count") == applied
    chex.assert_trees_all_close(params, clean_params, rtol=RTOL, atol=ATOL)
    _assert_close(inner_state, clean_state, rel=STATE_RTOL)
    # Training moved the params far beyond the tolerance, so the comparison means something.
    moved = [
        np.abs(np.asarray(p) - q).max()
        for p, q in zip(*map(jax.tree.leaves, (params, init)), strict=True)
    ]
    assert max(moved) > 0.1


@pytest.mark.parametrize(
    ("hysteresis", "consecutive"),
    [(1, False), (3, False), (3, True)],
    ids=["h1", "h3", "h3-consecutive"],
)
def test_soak_single_device(hysteresis, consecutive):
    ls = _loss_scale(hysteresis, consecutive)
    tx = jls.loss_scaled(_inner(), ls)
    params = _init_params(0)
    x, y = _data(STEPS, 16, seed=1)
    schedule = _schedule(STEPS, 0.25, BURST, seed=2 + hysteresis + consecutive)
    # About a quarter of the steps besides the burst, each kind and each leaf often.
    counts = np.bincount(schedule.kind, minlength=4)
    assert 0.2 * STEPS < STEPS - counts[0] - len(BURST) < 0.3 * STEPS
    assert counts[1:].min() > 0.2 * (STEPS - counts[0])
    assert np.bincount(schedule.leaf[schedule.injected]).min() > 50

    (final_params, opt_state), (stats, finite_flags) = _soak(
        tx, params, x, y, schedule.leaf, schedule.pos, schedule.value
    )

    _check_stats(stats, finite_flags, ls, schedule, BURST)
    applied = ~schedule.injected
    clean = _clean(_inner(), params, x[applied], y[applied])
    _check_matches_clean(final_params, opt_state.inner_state, clean, params, applied.sum())


@functools.partial(jax.pmap, axis_name=AXIS, static_broadcasted_argnums=0)
def _soak_pmap(tx, params, x, y, leaf_before, leaf_after, pos, value):
    """`_soak` on every device with its own batch; gradients are pmean'ed.

    `leaf_before` writes into this device's scaled gradients before the pmean (the
    value reaches every device), `leaf_after` into its copy of the mean (only this
    device sees it; `axis_name` must make the others skip too).
    """

    def step(carry, inputs):
        params, opt_state = carry
        x, y, leaf_before, leaf_after, pos, value = inputs
        scale = jls.get_loss_scale(opt_state)
        scaled_grads = jax.grad(lambda p: _loss(p, x, y) * scale)(params)
        scaled_grads = _inject(scaled_grads, leaf_before, pos, value)
        scaled_grads = jax.lax.pmean(scaled_grads, AXIS)
        scaled_grads = _inject(scaled_grads, leaf_after, pos, value)
        updates, opt_state = tx.update(scaled_grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), (jls.get_loss_scale_stats(opt_state), _all_finite(params))

    inputs = (x, y, leaf_before, leaf_after, pos, value)
    return jax.lax.scan(step, (params, tx.init(params)), inputs)


def _on_device(tree, device: int):
    return jax.tree.map(lambda a: a[device], tree)


def _per_device(schedule: Schedule, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The injecting device (in turn, one per injected step) and per-device leaf arrays."""
    rng = np.random.RandomState(seed)
    steps = len(schedule.kind)
    device = np.where(schedule.injected, np.cumsum(schedule.injected) % NUM_DEVICES, -1)
    after_mean = rng.random_sample(steps) < 0.5
    mine = device[None, :] == np.arange(NUM_DEVICES)[:, None]
    leaf_before = np.where(mine & ~after_mean, schedule.leaf, -1)
    leaf_after = np.where(mine & after_mean, schedule.leaf, -1)
    return device, leaf_before, leaf_after


@pytest.mark.parametrize(
    ("hysteresis", "consecutive"), [(2, False), (2, True)], ids=["h2", "h2-consecutive"]
)
def test_soak_pmap_one_device_overflows(hysteresis, consecutive):
    ls = _loss_scale(hysteresis, consecutive)
    tx = jls.loss_scaled(_inner(), ls, axis_name=AXIS)
    params = _init_params(0)
    x, y = _data(PMAP_STEPS, NUM_DEVICES * PER_DEVICE_BATCH, seed=5)
    schedule = _schedule(PMAP_STEPS, 0.25, PMAP_BURST, seed=6 + consecutive)
    device, leaf_before, leaf_after = _per_device(schedule, seed=8)
    assert set(device[schedule.injected]) == set(range(NUM_DEVICES))
    assert (leaf_before >= 0).any()
    assert (leaf_after >= 0).any()

    def split(batch):  # [step, 8 * b, ...] -> [device, step, b, ...]
        return np.moveaxis(batch.reshape(PMAP_STEPS, NUM_DEVICES, PER_DEVICE_BATCH, -1), 1, 0)

    def replicate(array):
        return np.broadcast_to(array, (NUM_DEVICES, *np.shape(array)))

    (final_params, opt_state), (stats, finite_flags) = _soak_pmap(
        tx,
        jax.tree.map(replicate, params),
        split(x),
        split(y),
        leaf_before,
        leaf_after,
        replicate(schedule.pos),
        replicate(schedule.value),
    )
    final_params, opt_state, stats = jax.device_get((final_params, opt_state, stats))

    outputs = (final_params, opt_state, stats)
    for d in range(1, NUM_DEVICES):
        chex.assert_trees_all_equal(_on_device(outputs, d), _on_device(outputs, 0))
    final_params, opt_state, stats = _on_device(outputs, 0)
    _check_stats(stats, finite_flags, ls, schedule, PMAP_BURST)
    applied = ~schedule.injected
    clean = _clean(_inner(), params, x[applied], y[applied])
    _check_matches_clean(final_params, opt_state.inner_state, clean, params, applied.sum())
