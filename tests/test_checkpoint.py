"""Checkpoints with orbax: save, restore onto `jax.eval_shape` targets, resume bit-identically.

Every run below trains on the same deterministic sequence of per-step inputs, some of which
hold inf or NaN, with a `DynamicLossScale(2**10, increment_period=4, hysteresis=3)`.
"""

import json
from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_lossscale as jls

from helpers import assert_bits_equal, jitted

STEPS = 16
W_SHAPE = (16, 8)
B_SHAPE = (8,)
NON_FINITE = {6: ("w", (0, 0), np.inf), 8: ("b", (3,), np.nan), 9: ("w", (5, 2), -np.inf)}
NON_FINITE[14] = ("b", (0,), np.inf)

# Steps 0-3 finite (growth at 3), 6 overflows (hysteresis 3 -> 2, no backoff), 8 overflows
# (2 -> 1), 9 overflows (backoff), 10-13 finite (growth at 13, tolerance refilled), 14 overflows.
EXPECTED_SCALES = [1024.0] * 3 + [2048.0] * 6 + [1024.0] * 4 + [2048.0] * 3

# Step after which the run is saved -> (scale, good_steps, overflows_until_backoff) and
# (skipped, NaN-skipped, inf-skipped, consecutive skipped steps, last_step_applied) at that point.
SAVE_POINTS = {
    "mid_good_steps": (5, ((2048.0, 2, 3), (0, 0, 0, 0, True))),
    "after_skip_mid_hysteresis": (6, ((2048.0, 0, 2), (1, 0, 1, 1, False))),
    "finite_step_mid_hysteresis": (7, ((2048.0, 1, 2), (1, 0, 1, 0, True))),
    "after_skip_with_backoff": (9, ((1024.0, 0, 1), (3, 1, 2, 2, False))),
    "mid_good_steps_after_backoff": (11, ((1024.0, 2, 1), (3, 1, 2, 0, True))),
}


def _loss_scale() -> jls.DynamicLossScale:
    return jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=4, hysteresis=3)


def _adam(ls: jls.LossScale) -> optax.GradientTransformation:
    return jls.loss_scaled(optax.adam(1e-2), ls)


def _chained_adamw_with_schedule(ls: jls.LossScale) -> optax.GradientTransformation:
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))
    return optax.chain(optax.identity(), jls.loss_scaled(inner, ls))


MAKE_TX = {"adam": _adam, "chain_clip_adamw_schedule": _chained_adamw_with_schedule}


def _initial_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=W_SHAPE), jnp.float32),
        "b": jnp.asarray(rng.normal(size=B_SHAPE), jnp.float32),
    }


def _inputs() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    xs = []
    for step in range(STEPS):
        x = {
            "w": rng.normal(size=W_SHAPE).astype(np.float32),
            "b": rng.normal(size=B_SHAPE).astype(np.float32),
        }
        if step in NON_FINITE:
            name, index, value = NON_FINITE[step]
            x[name][index] = value
        xs.append(x)
    return xs


XS = _inputs()


def _loss(params, x):
    sq = jnp.sum(params["w"] ** 2) + jnp.sum(params["b"] ** 2)
    return jnp.sum(params["w"] * x["w"]) + jnp.sum(params["b"] * x["b"]) + 0.5 * sq


def _jitted_step(tx: optax.GradientTransformation) -> tuple[Callable, list]:
    """A jitted train step, and a list that grows by one each time the step is traced."""
    traces = []

    def step(params, opt_state, x):
        traces.append(None)
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: _loss(p, x) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step), traces


def _run(step, params, opt_state, steps, on_step=None):
    """Runs `steps`; returns the final params and state, and the scale after each step."""
    scales = []
    for t in steps:
        params, opt_state = step(params, opt_state, XS[t])
        scales.append(float(jls.get_loss_scale(opt_state)))
        if on_step is not None:
            on_step(t, params, opt_state)
    return params, opt_state, scales


def _assert_bitwise_equal(actual, expected):
    chex.assert_trees_all_equal(actual, expected, strict=True)  # weak types too
    assert_bits_equal(actual, expected)


def _wrapper_state(opt_state) -> jls.LossScaledState:
    (found,) = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, jls.LossScaledState))
        if isinstance(node, jls.LossScaledState)
    ]
    return found


def _assert_typed_like_init(opt_state):
    """The restored wrapper state has the library's NamedTuples and exact, strong dtypes."""
    state = _wrapper_state(opt_state)
    assert type(state) is jls.LossScaledState
    assert type(state.loss_scale_state) is jls.DynamicLossScaleState
    assert type(state.stats) is jls.StepStats
    expected_dtypes = (
        jls.DynamicLossScaleState(jnp.float32, jnp.int32, jnp.int32),
        jls.StepStats(jnp.float32, *[jnp.int32] * 5, jnp.bool_),
    )
    for leaf, dtype in zip(
        jax.tree.leaves((state.loss_scale_state, state.stats)),
        jax.tree.leaves(expected_dtypes),
        strict=True,
    ):
        assert isinstance(leaf, jax.Array)
        assert leaf.shape == ()
        assert leaf.dtype == dtype
        assert not leaf.weak_type
    for leaf in jax.tree.leaves(opt_state):
        assert isinstance(leaf, jax.Array)
        assert not leaf.weak_type


def _assert_save_point(opt_state, expected):
    (scale, good_steps, overflows_until_backoff), (*skip_counts, last_step_applied) = expected
    skipped, nan_skipped, inf_skipped, consecutive = map(np.int32, skip_counts)
    state = _wrapper_state(opt_state)
    stats = jls.get_loss_scale_stats(state)
    # Every skip in these runs is an overflow, whose norm is NaN (a NaN among the gradients)
    # or +inf (an infinity alone); an applied step's norm is finite.
    assert bool(np.isfinite(stats.grad_norm)) == last_step_applied
    assert last_step_applied or np.isnan(stats.grad_norm) or stats.grad_norm == np.inf
    chex.assert_trees_all_equal(
        (state.loss_scale_state, stats._replace(grad_norm=np.float32(0))),
        (
            jls.DynamicLossScaleState(
                np.float32(scale), np.int32(good_steps), np.int32(overflows_until_backoff)
            ),
            jls.LossScaleStats(
                loss_scale=np.float32(scale),
                grad_norm=np.float32(0),
                skipped_steps=skipped,
                nan_skipped_steps=nan_skipped,
                inf_skipped_steps=inf_skipped,
                spike_skipped_steps=np.int32(0),
                consecutive_skipped_steps=consecutive,
                last_step_applied=np.bool_(last_step_applied),
            ),
        ),
        strict=True,
    )


def _abstract_checkpoint(tx, params):
    return {
        "params": jax.eval_shape(lambda: params),
        "opt_state": jax.eval_shape(tx.init, params),
    }


RESUME_CASES = [("adam", name) for name in SAVE_POINTS] + [
    ("chain_clip_adamw_schedule", "mid_good_steps"),
    ("chain_clip_adamw_schedule", "after_skip_with_backoff"),
]


@pytest.mark.parametrize(
    ("make_tx", "save_point"),
    [(MAKE_TX[tx], SAVE_POINTS[point]) for tx, point in RESUME_CASES],
    ids=[f"{tx}-{point}" for tx, point in RESUME_CASES],
)
def test_standard_checkpointer_resume_is_bit_identical(tmp_path, make_tx, save_point):
    save_after, expected_at_save = save_point
    tx = make_tx(_loss_scale())
    step, traces = _jitted_step(tx)
    params = _initial_params()
    path = tmp_path / "checkpoint"
    saved = {}

    with ocp.StandardCheckpointer() as checkpointer:

        def save(t, params, opt_state):
            if t == save_after:
                saved.update(params=params, opt_state=opt_state)
                checkpointer.save(path, {"params": params, "opt_state": opt_state})

        final_params, final_state, scales = _run(
            step, params, tx.init(params), range(STEPS), on_step=save
        )
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(path, _abstract_checkpoint(tx, params))

    assert scales == EXPECTED_SCALES
    _assert_save_point(saved["opt_state"], expected_at_save)
    _assert_bitwise_equal(restored, saved)
    _assert_typed_like_init(restored["opt_state"])
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(final_state)

    resumed_params, resumed_state, resumed_scales = _run(
        step, restored["params"], restored["opt_state"], range(save_after + 1, STEPS)
    )
    assert resumed_scales == EXPECTED_SCALES[save_after + 1 :]
    _assert_bitwise_equal(resumed_params, final_params)
    _assert_bitwise_equal(resumed_state, final_state)
    assert len(traces) == 1  # the restored state hits the step compiled for the original


@pytest.mark.parametrize(
    "loss_scale",
    [
        jls.DynamicLossScale(initial_loss_scale=64.0, increment_period=3, hysteresis=3),
        jls.FixedLossScale(64.0),
    ],
    ids=["dynamic", "fixed"],
)
def test_loss_scale_state_restores_onto_eval_shape_of_init(tmp_path, loss_scale):
    finite = {"w": jnp.ones(3)}
    overflow = {"w": jnp.array([1.0, jnp.nan, 0.0])}
    state = loss_scale.init()
    for grads in (finite, overflow):
        state, _ = loss_scale.update(state, grads)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ls", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ls", jax.eval_shape(loss_scale.init))

    assert type(restored) is type(state)
    _assert_bitwise_equal(restored, state)
    for leaf in jax.tree.leaves(restored):
        assert not leaf.weak_type
    if isinstance(loss_scale, jls.DynamicLossScale):
        # One overflow counted since init, the hysteresis window not yet spent.
        chex.assert_trees_all_equal(
            restored,
            jls.DynamicLossScaleState(np.float32(64.0), np.int32(0), np.int32(2)),
            strict=True,
        )
    for grads in (overflow, overflow, finite):
        expected = jitted(loss_scale.update, state, grads)
        actual = jitted(loss_scale.update, restored, grads)
        _assert_bitwise_equal(actual, expected)
        state, restored = expected[0], actual[0]


def test_hyperparameters_as_json_beside_checkpoint_rebuild_the_run(tmp_path):
    ls = jls.DynamicLossScale(
        initial_loss_scale=2.0**10,
        increment_period=4,
        multiplier=2.0,
        backoff_factor=0.5,
        min_loss_scale=2.0,
        max_loss_scale=2.0**20,
        hysteresis=3,
    )
    tx = _chained_adamw_with_schedule(ls)
    step, _ = _jitted_step(tx)
    params = _initial_params()
    save_after = SAVE_POINTS["after_skip_mid_hysteresis"][0]

    with ocp.StandardCheckpointer() as checkpointer:

        def save(t, params, opt_state):
            if t == save_after:
                checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
                with open(tmp_path / "loss_scale.json", "w") as f:
                    json.dump(jls.serialize(ls), f)

        final_params, final_state, scales = _run(
            step, params, tx.init(params), range(STEPS), on_step=save
        )
        checkpointer.wait_until_finished()

        with open(tmp_path / "loss_scale.json") as f:
            rebuilt = jls.deserialize(json.load(f))
        assert rebuilt is not ls
        assert rebuilt == ls
        assert hash(rebuilt) == hash(ls)
        assert rebuilt.get_config() == ls.get_config()

        rebuilt_tx = _chained_adamw_with_schedule(rebuilt)
        restored = checkpointer.restore(tmp_path / "ckpt", _abstract_checkpoint(rebuilt_tx, params))

    assert scales == EXPECTED_SCALES
    _assert_typed_like_init(restored["opt_state"])
    rebuilt_step, _ = _jitted_step(rebuilt_tx)
    resumed_params, resumed_state, resumed_scales = _run(
        rebuilt_step, restored["params"], restored["opt_state"], range(save_after + 1, STEPS)
    )
    assert resumed_scales == EXPECTED_SCALES[save_after + 1 :]
    _assert_bitwise_equal(resumed_params, final_params)
    _assert_bitwise_equal(resumed_state, final_state)


def test_checkpoint_manager_resumes_from_latest_step_after_interruption(tmp_path):
    ls = _loss_scale()
    tx = _adam(ls)
    step, traces = _jitted_step(tx)
    params = _initial_params()
    final_params, final_state, scales = _run(step, params, tx.init(params), range(STEPS))
    assert scales == EXPECTED_SCALES

    options = ocp.CheckpointManagerOptions(save_interval_steps=3, max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:

        def save(t, params, opt_state):
            state = ocp.args.StandardSave({"params": params, "opt_state": opt_state})
            config = ocp.args.JsonSave(jls.serialize(ls))
            manager.save(t, args=ocp.args.Composite(state=state, loss_scale=config))

        # Interrupted after step 10; step 9 (a skip that backed off the scale) is the latest save.
        _run(step, params, tx.init(params), range(11), on_step=save)
        manager.wait_until_finished()
        assert manager.all_steps() == [6, 9]

    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        latest = manager.latest_step()
        assert latest == 9
        config = manager.restore(latest, args=ocp.args.Composite(loss_scale=ocp.args.JsonRestore()))
        rebuilt = jls.deserialize(config.loss_scale)
        assert rebuilt == ls
        rebuilt_tx = _adam(rebuilt)
        target = ocp.args.StandardRestore(_abstract_checkpoint(rebuilt_tx, params))
        restored = manager.restore(latest, args=ocp.args.Composite(state=target)).state

    _assert_typed_like_init(restored["opt_state"])
    _assert_save_point(restored["opt_state"], SAVE_POINTS["after_skip_with_backoff"][1])
    resumed_params, resumed_state, resumed_scales = _run(
        step, restored["params"], restored["opt_state"], range(latest + 1, STEPS)
    )
    assert resumed_scales == EXPECTED_SCALES[latest + 1 :]
    _assert_bitwise_equal(resumed_params, final_params)
    _assert_bitwise_equal(resumed_state, final_state)
    assert len(traces) == 1


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("data",))


MESH8 = _mesh(8)

# How each layout places an array of a given shape: w, b (and adam's moments), scalars.
LAYOUTS = {
    "rows_on_8": {W_SHAPE: P("data"), B_SHAPE: P("data"), (): P()},
    "replicated_on_8": {W_SHAPE: P(), B_SHAPE: P(), (): P()},
    "columns_on_8": {W_SHAPE: P(None, "data"), B_SHAPE: P(), (): P()},
    "rows_on_4": {W_SHAPE: P("data"), B_SHAPE: P("data"), (): P()},
}


def _layout_sharding(layout: str, shape: tuple[int, ...]) -> NamedSharding:
    mesh = _mesh(4) if layout.endswith("_on_4") else MESH8
    return NamedSharding(mesh, LAYOUTS[layout][shape])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_state_restores_with_requested_shardings(tmp_path, layout):
    tx = _adam(_loss_scale())
    step, _ = _jitted_step(tx)

    def place(tree, layout):
        return jax.tree.map(lambda x: jax.device_put(x, _layout_sharding(layout, x.shape)), tree)

    params = place(_initial_params(), "rows_on_8")
    opt_state = place(tx.init(params), "rows_on_8")
    save_after = SAVE_POINTS["after_skip_mid_hysteresis"][0]
    params, opt_state, _ = _run(step, params, opt_state, range(save_after + 1))
    saved = {"params": params, "opt_state": opt_state}
    assert saved["params"]["w"].sharding == NamedSharding(MESH8, P("data"))
    assert (
        _wrapper_state(opt_state).inner_state[0].mu["w"].sharding == saved["params"]["w"].sharding
    )
    final_params, final_state, _ = _run(step, params, opt_state, range(save_after + 1, STEPS))

    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=_layout_sharding(layout, s.shape)
        ),
        _abstract_checkpoint(tx, _initial_params()),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "sharded", saved)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "sharded", target)

    shardings = jax.tree.map(lambda x: x.sharding, restored)
    requested = jax.tree.map(lambda s: s.sharding, target)
    assert shardings == requested
    _assert_bitwise_equal(restored, saved)
    _assert_typed_like_init(restored["opt_state"])
    _assert_save_point(restored["opt_state"], SAVE_POINTS["after_skip_mid_hysteresis"][1])

    resumed_params, resumed_state, _ = _run(
        step, restored["params"], restored["opt_state"], range(save_after + 1, STEPS)
    )
    if layout == "rows_on_8":  # the layout it was saved in: the same program, the same bits
        _assert_bitwise_equal(resumed_params, final_params)
        _assert_bitwise_equal(resumed_state, final_state)
    else:  # another layout compiles another program; XLA may contract multiply-adds otherwise
        chex.assert_trees_all_close(resumed_params, final_params, rtol=1e-6, atol=0)
        chex.assert_trees_all_close(resumed_state, final_state, rtol=1e-6, atol=0)
        resumed_stats = _wrapper_state(resumed_state).stats
        final_stats = _wrapper_state(final_state).stats
        chex.assert_trees_all_equal(  # the norm sums in another order
            resumed_stats._replace(grad_norm=0), final_stats._replace(grad_norm=0)
        )
        np.testing.assert_allclose(resumed_stats.grad_norm, final_stats.grad_norm, rtol=1e-6)


def test_flax_serialization_round_trips_a_linen_train_state_mid_hysteresis():
    """`flax.serialization.to_bytes` of a linen `TrainState`, the checkpoint of many linen code
    bases: the state holds arrays only, so msgpack takes it and the run resumes bit for bit."""
    from flax import serialization
    from flax.training import train_state

    tx = _adam(_loss_scale())
    step, _ = _jitted_step(tx)
    save_after = SAVE_POINTS["after_skip_mid_hysteresis"][0]
    params, opt_state, _ = _run(
        step, _initial_params(), tx.init(_initial_params()), range(save_after + 1)
    )
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.replace(opt_state=opt_state)

    template = train_state.TrainState.create(apply_fn=None, params=_initial_params(), tx=tx)
    restored = serialization.from_bytes(template, serialization.to_bytes(state))
    restored = jax.device_put(restored)  # msgpack gives NumPy arrays back

    _assert_typed_like_init(restored.opt_state)
    _assert_bitwise_equal((restored.params, restored.opt_state), (params, opt_state))
    _assert_save_point(restored.opt_state, SAVE_POINTS["after_skip_mid_hysteresis"][1])
    final = _run(step, params, opt_state, range(save_after + 1, STEPS))
    resumed = _run(step, restored.params, restored.opt_state, range(save_after + 1, STEPS))
    _assert_bitwise_equal(resumed[:2], final[:2])


def _sgd_nesterov() -> optax.GradientTransformation:
    return optax.sgd(1e-2, momentum=0.9, nesterov=True)


def _clip_adamw_schedule() -> optax.GradientTransformation:
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))


EXPECTED_COUNTS = {
    "adam": 1,
    "sgd_nesterov": 0,
    "chain_clip_adamw_schedule": 2,
}  # adamw's, schedule's
BARE_INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "sgd_nesterov": _sgd_nesterov,
    "chain_clip_adamw_schedule": _clip_adamw_schedule,
}


def _bare_run(inner, params, opt_state, steps):
    """The bare optimizer on the true gradients of the finite steps among `steps`."""

    @jax.jit
    def step(params, opt_state, x):
        updates, opt_state = inner.update(jax.grad(_loss)(params, x), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for t in steps:
        if t not in NON_FINITE:
            params, opt_state = step(params, opt_state, XS[t])
    return params, opt_state


def _assert_close_with_equal_counts(actual, expected):
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_equal_dtypes(actual, expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(want.dtype, jnp.integer):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _save_and_restore(path, tree, target):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        return checkpointer.restore(path, target)


@pytest.mark.parametrize("inner_name", list(BARE_INNERS))
def test_a_checkpoint_saved_without_loss_scaling_continues_inside_it(tmp_path, inner_name):
    """docs/checkpoints.md: `tx.init(params)._replace(inner_state=restored)` takes a bare optax
    checkpoint into loss scaling. The steps that follow (6, 8 and 9 overflow) give the params
    and optimizer state of the bare optimizer run on the finite steps alone: the skips and the
    counts exactly, the values to rounding (XLA fuses the unscale into the update)."""
    inner = BARE_INNERS[inner_name]()
    params = _initial_params()
    params, bare_state = _bare_run(inner, params, inner.init(params), range(5))
    target = {"params": params, "opt_state": jax.eval_shape(inner.init, params)}
    restored = _save_and_restore(
        tmp_path / "bare", {"params": params, "opt_state": bare_state}, target
    )
    _assert_bitwise_equal(restored["opt_state"], bare_state)

    tx = jls.loss_scaled(inner, _loss_scale())
    opt_state = tx.init(restored["params"])._replace(inner_state=restored["opt_state"])
    step, traces = _jitted_step(tx)
    scaled_params, opt_state, scales = _run(step, restored["params"], opt_state, range(5, 10))

    expected_params, expected_state = _bare_run(inner, params, bare_state, range(5, 10))
    assert scales == [1024.0] * 4 + [512.0]  # the loss scale starts afresh: 3 overflows, a backoff
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 3
    _assert_close_with_equal_counts(
        (scaled_params, opt_state.inner_state), (expected_params, expected_state)
    )
    assert len(traces) == 1


@pytest.mark.parametrize("inner_name", list(BARE_INNERS))
def test_leaving_loss_scaling_keeps_the_optimizer_state_of_the_applied_steps(tmp_path, inner_name):
    """docs/checkpoints.md: `opt_state.inner_state`, saved alone, restores into the bare
    optimizer, which continues as if it had run on the applied (finite) steps only."""
    inner = BARE_INNERS[inner_name]()
    tx = jls.loss_scaled(inner, _loss_scale())
    step, _ = _jitted_step(tx)
    params, opt_state, _ = _run(step, _initial_params(), tx.init(_initial_params()), range(10))
    restored = _save_and_restore(
        tmp_path / "unscaled", opt_state.inner_state, jax.eval_shape(inner.init, params)
    )

    resumed_params, resumed_state = _bare_run(inner, params, restored, range(10, STEPS))
    expected_params, expected_state = _bare_run(
        inner, _initial_params(), inner.init(_initial_params()), range(STEPS)
    )
    _assert_close_with_equal_counts(
        (resumed_params, resumed_state), (expected_params, expected_state)
    )
    counts = [leaf for leaf in jax.tree.leaves(resumed_state) if leaf.dtype == jnp.int32]
    assert [int(count) for count in counts] == [STEPS - len(NON_FINITE)] * EXPECTED_COUNTS[
        inner_name
    ]


class _EarlierSpikeWindows(NamedTuple):
    """The spike windows' layout before their fields were renamed (and the count of spikes in
    a row added): `grad_norm` shared its name with the stat, which `optax.tree_utils.tree_get`
    could then not find."""

    grad_norm: Any
    loss: Any


def test_a_checkpoint_of_the_earlier_spike_window_layout_restores_and_resumes(tmp_path):
    """docs/checkpoints.md: restored onto a target with the windows' earlier names, the windows
    go into a fresh state's, and the run continues bit for bit."""
    tx = jls.loss_scaled(optax.adam(0.1), _loss_scale(), skip_spike_sigmas=1.0, spike_window=3)
    step, _ = _jitted_step(tx)
    params = _initial_params()
    final_params, final_state, _ = _run(step, params, tx.init(params), range(STEPS))
    stats = jls.get_loss_scale_stats(final_state)
    assert (int(stats.spike_skipped_steps), int(stats.inf_skipped_steps)) == (1, 3)

    saved_params, saved_state, _ = _run(step, params, tx.init(params), range(8))
    windows = saved_state.spike_windows
    assert int(jls.get_loss_scale_stats(saved_state).spike_skipped_steps) == 1
    assert int(windows.spikes_in_a_row) == 0
    assert int(windows.recent_grad_norms.filled) == 3
    earlier = saved_state._replace(
        spike_windows=_EarlierSpikeWindows(windows.recent_grad_norms, windows.recent_losses)
    )
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "earlier", {"params": saved_params, "opt_state": earlier})
        checkpointer.wait_until_finished()
        target = jax.eval_shape(tx.init, params)
        with pytest.raises(ValueError, match="recent_grad_norms"):  # the new target: refused
            checkpointer.restore(tmp_path / "earlier", {"params": params, "opt_state": target})
        renamed = {
            "grad_norm": target.spike_windows.recent_grad_norms,
            "loss": target.spike_windows.recent_losses,
        }
        target = {"params": params, "opt_state": target._replace(spike_windows=renamed)}
        restored = checkpointer.restore(tmp_path / "earlier", target)
    old = restored["opt_state"].spike_windows
    fresh = tx.init(params).spike_windows
    windows = fresh._replace(recent_grad_norms=old["grad_norm"], recent_losses=old["loss"])
    resumed_state = restored["opt_state"]._replace(spike_windows=windows)
    _assert_bitwise_equal((restored["params"], resumed_state), (saved_params, saved_state))
    resumed = _run(step, restored["params"], resumed_state, range(8, STEPS))[:2]
    _assert_bitwise_equal(resumed, (final_params, final_state))


# --- issue 46: a Kahan buffer of another kind is refused, not cast ---------------------------


@pytest.mark.parametrize(
    ("saved_dtype", "target_dtype", "missing"),
    [
        (None, jnp.float32, "float32"),
        (None, jnp.bfloat16, "bfloat16"),
        (jnp.float32, None, "int16"),
        (jnp.bfloat16, None, "int16"),
        (jnp.float32, jnp.bfloat16, "bfloat16"),  # was cast: the buffer's low bits dropped
        (jnp.bfloat16, jnp.float32, "float32"),
    ],
)
def test_a_kahan_buffer_restored_into_another_kind_or_dtype_is_a_structure_error(
    tmp_path, saved_dtype, target_dtype, missing
):
    params = {"w": jnp.asarray(np.linspace(1, 2, 6, dtype=np.float32).astype(jnp.bfloat16))}
    saved_tx = optax.chain(optax.sgd(1e-4), jls.kahan_summation(saved_dtype))
    step = jax.jit(lambda p, s: saved_tx.update(jax.tree.map(jnp.ones_like, p), s, p))
    _, opt_state = step(params, saved_tx.init(params))
    if saved_dtype is None:  # the low bits of the sum: up to 2**15 as values
        assert np.abs(np.asarray(opt_state[1].low_bits["w"])).max() > 1000
    target_tx = optax.chain(optax.sgd(1e-4), jls.kahan_summation(target_dtype))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", opt_state)
        checkpointer.wait_until_finished()
        with pytest.raises(ValueError, match=rf"Structure mismatch: .*'stored_in', '{missing}'"):
            checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(target_tx.init, params))
        restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(saved_tx.init, params))
    assert_bits_equal(restored, opt_state)
