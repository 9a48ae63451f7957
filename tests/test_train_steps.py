"""Train steps as users write them: donated buffers, one scale, mixed dtypes, changed settings.

Each section pins one behaviour that a jitted, donated train step relies on: the state holds
no buffer twice; the scale lives in one place, whatever the `LossScale`; inner optimizers whose
state changes dtype work, and a skip keeps their values; float8 leaves mix with other floats;
a state saved under other hyperparameters obeys the current ones from its next update on;
`count_non_finite` saturates; and what a skip keeps bit for bit on the CPU.
"""

import dataclasses
import functools
import importlib.metadata
import pathlib
import re
import tomllib
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jax_lossscale as jls

from helpers import assert_bits_equal, bits, device_array, jitted

ROOT = pathlib.Path(__file__).resolve().parent.parent


class PowerOfTwoState(NamedTuple):
    exponent: jax.Array  # int32

    @property
    def loss_scale(self) -> jax.Array:  # where get_loss_scale reads the scale
        return jnp.exp2(self.exponent.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class PowerOfTwoLossScale(jls.LossScale):
    """A user loss scale whose state holds no float: its `loss_scale` is 2**exponent.

    It backs off by one power of two on a non-finite step and never grows.
    """

    initial_exponent: int = 10

    def init(self):
        return PowerOfTwoState(jnp.asarray(self.initial_exponent, jnp.int32))

    def __call__(self, state):
        return state.loss_scale

    def adjust(self, state, grads_finite):
        finite = grads_finite
        return PowerOfTwoState(jnp.where(finite, state.exponent, state.exponent - 1)), finite

    def get_config(self):
        return {"initial_exponent": self.initial_exponent}


LOSS_SCALES = {
    "dynamic": jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2),
    "fixed": jls.FixedLossScale(2.0**10),
    "power_of_two": PowerOfTwoLossScale(10),
}
INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "chain_clip_adamw_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10))
    ),
}


def loss_fn(params, x, y):  # float32 master weights, float16 compute, float32 loss
    prediction = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"]
    return jnp.mean((prediction.astype(jnp.float32) - y) ** 2)


def train_step_of(tx):
    def train_step(params, opt_state, x, y):
        loss_scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_fn(p, x, y) * loss_scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


def make_train_step(tx, **jit_kwargs):
    return jax.jit(train_step_of(tx), **jit_kwargs)


def data(step):
    """Step 2 overflows float16 at any scale >= 2**4; the others are finite at 2**12."""
    x = np.full((8, 4), 1e4 if step == 2 else 0.5, np.float32)
    return jnp.asarray(x), jnp.asarray(np.ones((8, 1), np.float32))


def initial_params():
    return {"w": jnp.full((4, 1), 0.25), "b": jnp.zeros((1,))}


def buffer_pointers(tree):
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)]


# --- 1. donation: no buffer twice -----------------------------------------------------------


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
def test_no_buffer_appears_twice_in_a_state_from_init_or_an_eager_update(loss_scale, make_inner):
    tx = jls.loss_scaled(make_inner(), loss_scale)
    params = initial_params()
    opt_state = tx.init(params)
    pointers = buffer_pointers(opt_state)
    assert len(pointers) == len(set(pointers))
    for grads in (
        {"w": jnp.ones((4, 1)), "b": jnp.ones(1)},
        {"w": jnp.ones((4, 1)), "b": jnp.full(1, jnp.inf)},
    ):
        _, opt_state = tx.update(grads, opt_state, params)  # eager, op by op
        pointers = buffer_pointers(opt_state)
        assert len(pointers) == len(set(pointers))


def test_an_inner_init_that_keeps_the_params_is_donated_from_the_first_step():
    """Bare optax's state of `optax.contrib.prodigy` holds the params' own arrays, and a step
    that donates params and state fails ("donate the same buffer twice"); the wrapper's holds
    copies, and its donated steps match undonated ones."""
    params = initial_params()
    bare_pointers = buffer_pointers((params, optax.contrib.prodigy(1.0).init(params)))
    assert len(bare_pointers) > len(set(bare_pointers))
    tx = jls.loss_scaled(optax.contrib.prodigy(1.0), LOSS_SCALES["dynamic"])
    opt_state = tx.init(params)
    pointers = buffer_pointers((params, opt_state))
    assert len(pointers) == len(set(pointers))
    grads = {"w": jnp.full((4, 1), 2048.0), "b": jnp.full(1, 1024.0)}

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    donated, plain = jax.jit(step, donate_argnums=(0, 1)), jax.jit(step)
    ref_params, ref_state = initial_params(), tx.init(initial_params())
    for _ in range(3):
        params, opt_state = donated(params, opt_state, grads)
        ref_params, ref_state = plain(ref_params, ref_state, grads)
    assert_bits_equal((params, opt_state), (ref_params, ref_state))
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 0


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
@pytest.mark.parametrize("make_inner", INNERS.values(), ids=INNERS.keys())
def test_donated_train_step_from_eager_init_matches_the_undonated_one(loss_scale, make_inner):
    tx = jls.loss_scaled(make_inner(), loss_scale)
    donated_step = make_train_step(tx, donate_argnums=(0, 1))
    plain_step = make_train_step(tx)
    params, opt_state = initial_params(), tx.init(initial_params())
    ref_params, ref_state = initial_params(), tx.init(initial_params())
    # An eager update first: its state, too, must be donatable.
    _, opt_state = tx.update(jax.tree.map(jnp.zeros_like, params), opt_state, params)
    _, ref_state = tx.update(jax.tree.map(jnp.zeros_like, params), ref_state, params)
    scales = []
    for step in range(5):
        old_params = params
        params, opt_state = donated_step(params, opt_state, *data(step))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old_params))
        ref_params, ref_state = plain_step(ref_params, ref_state, *data(step))
        scales.append(float(jls.get_loss_scale(opt_state)))
    assert_bits_equal((params, opt_state), (ref_params, ref_state))
    expected_scales = {
        "DynamicLossScale": [2048.0, 2048.0, 1024.0, 1024.0, 2048.0],  # the eager step counts
        "FixedLossScale": [1024.0] * 5,
        "PowerOfTwoLossScale": [1024.0, 1024.0, 512.0, 512.0, 512.0],
    }[type(loss_scale).__name__]
    assert scales == expected_scales


def test_stats_returned_by_a_donated_step_outlive_the_next_step():
    tx = jls.loss_scaled(optax.adam(1e-2), LOSS_SCALES["dynamic"])

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        params, opt_state = train_step_of(tx)(params, opt_state, x, y)
        return params, opt_state, jls.get_loss_scale_stats(opt_state)

    params, opt_state = initial_params(), tx.init(initial_params())
    logged = []
    for index in range(4):
        params, opt_state, stats = step(params, opt_state, *data(index))
        logged.append(stats)
    assert [float(stats.loss_scale) for stats in logged] == [1024.0, 2048.0, 1024.0, 1024.0]
    assert [int(stats.skipped_steps) for stats in logged] == [0, 0, 1, 1]


# --- 2. one source of truth for the scale ---------------------------------------------------


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
def test_a_reset_loss_scale_state_is_what_get_loss_scale_reads_and_update_unscales_by(loss_scale):
    tx = jls.loss_scaled(optax.sgd(1.0), loss_scale)
    params = {"w": jnp.array([1.0, 2.0])}
    opt_state = tx.init(params)
    for _ in range(3):  # move the scale away from its initial value where it can move
        _, opt_state = tx.update({"w": jnp.array([jnp.inf, 0.0])}, opt_state, params)
    reset = opt_state._replace(
        loss_scale_state=type(loss_scale)(
            **{**loss_scale.get_config(), **_doubled_initial(loss_scale)}
        ).init()
    )
    scale = jls.get_loss_scale(reset)
    assert float(scale) == 2.0**11
    true_grads = {"w": jnp.array([0.5, -0.25])}
    scaled_grads = jax.tree.map(lambda g: g * scale, true_grads)
    updates, _ = jitted(tx.update, scaled_grads, reset, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.array([-0.5, 0.25])})


def _doubled_initial(loss_scale):
    if isinstance(loss_scale, PowerOfTwoLossScale):
        return {"initial_exponent": 11}
    if isinstance(loss_scale, jls.FixedLossScale):
        return {"loss_scale_value": 2.0**11}
    return {"initial_loss_scale": 2.0**11}


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
def test_the_scale_is_stored_once(loss_scale):
    opt_state = jls.loss_scaled(optax.adam(1e-3), loss_scale).init({"w": jnp.ones(3)})
    # The one other float32 scalar is the gradient norm.
    stats_without_norm = opt_state.stats._replace(grad_norm=None)
    outside_loss_scale_state = jax.tree.leaves(
        opt_state._replace(loss_scale_state=None, stats=stats_without_norm)
    )
    assert not [
        leaf for leaf in outside_loss_scale_state if leaf.dtype == jnp.float32 and leaf.shape == ()
    ]
    floats = [
        leaf for leaf in jax.tree.leaves(opt_state.loss_scale_state) if leaf.dtype == jnp.float32
    ]
    assert len(floats) == (0 if isinstance(loss_scale, PowerOfTwoLossScale) else 1)


class _ExponentOnly(NamedTuple):
    exponent: jax.Array


@dataclasses.dataclass(frozen=True)
class _NoScaleFieldLossScale(PowerOfTwoLossScale):
    """Its state does not say where the scale is: loss_scaled cannot read it."""

    def init(self):
        return _ExponentOnly(jnp.asarray(self.initial_exponent, jnp.int32))

    def __call__(self, state):
        return jnp.exp2(state.exponent.astype(jnp.float32))


def test_a_loss_scale_whose_state_holds_no_loss_scale_is_refused_by_loss_scaled():
    with pytest.raises(
        TypeError,
        match=re.escape(
            "loss_scaled(loss_scale=_NoScaleFieldLossScale(initial_exponent=10)): the state of a "
            "LossScale must hold its current scale as a float32 scalar loss_scale (a field or a "
            "property), where get_loss_scale reads it; _NoScaleFieldLossScale.init() returns "
            "_ExponentOnly with loss_scale of none"
        ),
    ):
        jls.loss_scaled(optax.sgd(0.1), _NoScaleFieldLossScale())


# --- 4. float8 leaves mixed with other floats -----------------------------------------------

# Zeros built by numpy and copied to the device: nothing is compiled at import.
FLOAT8_PARAMS = {
    "e4m3": jnp.asarray(np.zeros(2, jnp.float8_e4m3fn)),
    "e5m2": jnp.asarray(np.zeros(2, jnp.float8_e5m2)),
    "half": jnp.asarray(np.zeros(2, jnp.bfloat16)),
    "full": jnp.asarray(np.zeros(2, np.float32)),
}


@pytest.mark.parametrize(
    ("bad", "expected_kind"),
    [
        (None, None),
        (("e4m3", jnp.nan), "nan_skipped_steps"),
        (("e5m2", jnp.inf), "inf_skipped_steps"),
        (("full", -jnp.inf), "inf_skipped_steps"),
        (("half", jnp.nan), "nan_skipped_steps"),
    ],
    ids=["finite", "nan_in_e4m3fn", "inf_in_e5m2", "inf_in_float32", "nan_in_bfloat16"],
)
def test_float8_leaves_mixed_with_other_floats(jit_or_eager, bad, expected_kind):
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(1.0))
    # 448 is float8_e4m3fn's largest value: its square overflows, and e4m3fn has no inf.
    # Built by numpy (no op compiled), given to the update as jax arrays.
    host = {
        key: np.array([448.0, 0.5], np.float32).astype(x.dtype) for key, x in FLOAT8_PARAMS.items()
    }
    if bad is not None:
        key, value = bad
        host[key][1] = value
    grads = jax.tree.map(jnp.asarray, host)
    updates, opt_state = jit_or_eager(tx.update, grads, tx.init(FLOAT8_PARAMS), FLOAT8_PARAMS)
    stats = jls.get_loss_scale_stats(opt_state)
    if bad is None:
        assert_bits_equal(updates, jax.tree.map(np.negative, host))
        assert int(stats.skipped_steps) == 0
        return
    assert_bits_equal(updates, jax.tree.map(lambda x: np.full_like(x, -0.0), host))
    counts = {
        name: int(getattr(stats, name)) for name in ("nan_skipped_steps", "inf_skipped_steps")
    }
    assert counts == {name: int(name == expected_kind) for name in counts}


# --- 5. a state made under other hyperparameters obeys the current ones ---------------------


def _dynamic_state(scale, good_steps, overflows_until_backoff):
    return jls.DynamicLossScaleState(
        jnp.float32(scale), jnp.int32(good_steps), jnp.int32(overflows_until_backoff)
    )


# Built by numpy and copied to the device: nothing is compiled at import.
FINITE = {"w": jnp.asarray(np.ones(2, np.float32))}
NON_FINITE = {"w": device_array([1.0, np.inf])}

RESUMED = [
    # (id, the loss scale now, the saved state, gradients of the next update, state after it)
    ("above_new_max_finite", jls.DynamicLossScale(2.0**10, max_loss_scale=2.0**12),
     (2.0**20, 5, 1), FINITE, (2.0**12, 6, 1)),
    ("above_new_max_overflow", jls.DynamicLossScale(2.0**10, max_loss_scale=2.0**12),
     (2.0**20, 5, 1), NON_FINITE, (2.0**11, 0, 1)),
    ("below_new_min_finite", jls.DynamicLossScale(2.0**5, min_loss_scale=2.0**4),
     (1.0, 5, 1), FINITE, (2.0**4, 6, 1)),
    ("below_new_min_overflow", jls.DynamicLossScale(2.0**5, min_loss_scale=2.0**4),
     (1.0, 5, 1), NON_FINITE, (2.0**4, 0, 1)),
    ("hysteresis_lowered", jls.DynamicLossScale(2.0**10, hysteresis=1),
     (2.0**10, 0, 3), NON_FINITE, (2.0**9, 0, 1)),
    ("hysteresis_raised_keeps_count", jls.DynamicLossScale(2.0**10, hysteresis=3),
     (2.0**10, 0, 1), NON_FINITE, (2.0**9, 0, 1)),
    ("increment_period_lowered", jls.DynamicLossScale(2.0**10, increment_period=1000),
     (2.0**10, 1500, 1), FINITE, (2.0**11, 0, 1)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("loss_scale", "saved", "grads", "expected"),
    [case[1:] for case in RESUMED],
    ids=[case[0] for case in RESUMED],
)
def test_a_saved_state_obeys_the_current_hyperparameters_from_the_next_update(
    loss_scale, saved, grads, expected
):
    state = _dynamic_state(*saved)
    assert float(loss_scale(state)) == saved[0]  # read as saved until the next update
    new_state, _ = jitted(loss_scale.update, state, grads)
    chex.assert_trees_all_equal(new_state, _dynamic_state(*expected), strict=True)


def test_a_fixed_scale_state_takes_the_current_value_from_the_next_update():
    state = jls.FixedLossScale(128.0).init()
    new_state, should_apply = jitted(jls.FixedLossScale(1024.0).update, state, FINITE)
    chex.assert_trees_all_equal(new_state, jls.FixedLossScaleState(jnp.float32(1024.0)))
    assert bool(should_apply)


def test_a_checkpoint_resumed_with_a_lower_max_loss_scale(tmp_path):
    """Saved at 2**20, resumed under max_loss_scale=2**12 in a jitted, donated step."""
    params = initial_params()
    old_tx = jls.loss_scaled(optax.sgd(0.5), jls.DynamicLossScale(2.0**20))
    new_tx = jls.loss_scaled(optax.sgd(0.5), jls.DynamicLossScale(2.0**10, max_loss_scale=2.0**12))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "step", {"params": params, "opt_state": old_tx.init(params)})
        checkpointer.wait_until_finished()
        target = {"params": params, "opt_state": jax.eval_shape(new_tx.init, params)}
        restored = checkpointer.restore(tmp_path / "step", target)
    opt_state = restored["opt_state"]
    assert float(jls.get_loss_scale(opt_state)) == 2.0**20  # as saved, until the next update

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jnp.sum(p["w"]) * 2.0**-10 * scale)(params)
        updates, opt_state = new_tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = step(restored["params"], opt_state)
    # The gradient was unscaled by the 2**20 it was scaled with: sgd moved w by 0.5 * 2**-10.
    chex.assert_trees_all_equal(params["w"], jnp.full((4, 1), 0.25 - 2.0**-11))
    assert float(jls.get_loss_scale(opt_state)) == 2.0**12
    params, opt_state = step(params, opt_state)
    chex.assert_trees_all_equal(params["w"], jnp.full((4, 1), 0.25 - 2.0**-10))
    assert float(jls.get_loss_scale(opt_state)) == 2.0**12


# --- 7. what a skipped step keeps bit for bit -----------------------------------------------


def _float32_bits(*patterns):
    return jnp.asarray(np.array(patterns, np.uint32).view(np.float32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="pins XLA's CPU arithmetic")
def test_what_a_skip_keeps_through_apply_updates_on_cpu():
    half_bits = [0x3C00, 0x8000, 0x7C00, 0xFE01, 0x7E01, 0x7C01, 0x0001, 0x8001]
    params = {
        # 1, -0, +0, -inf, quiet NaNs with payloads; then 2 subnormals and a signalling NaN.
        "f32": _float32_bits(0x3F800000, 0x80000000, 0x00000000, 0xFF800000, 0x7FC12345,
                             0xFFC00001, 0x00000001, 0x80000001, 0x7F812345),
        # 1, -0, inf, -NaN and NaN with payloads, a signalling NaN, 2 subnormals.
        "bf16": jnp.asarray(np.array([0x3F80, 0x8000, 0x7F80, 0xFFC1, 0x7FC1, 0x7F81, 0x0001,
                                      0x8001], np.uint16).view(jnp.bfloat16)),
        "f16": jnp.asarray(np.array(half_bits, np.uint16).view(np.float16)),
    }  # fmt: skip
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale())
    opt_state = tx.init(params)

    @jax.jit
    def skipped_step(params, opt_state, grads):  # NaN gradients as an argument, not folded
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    nan_grads = jax.tree.map(lambda p: jnp.asarray(np.full_like(p, np.nan)), params)
    new_params, new_state = skipped_step(params, opt_state, nan_grads)
    got = bits(new_params)
    # float32: subnormals flushed to zeros of their sign, a signalling NaN quieted.
    np.testing.assert_array_equal(got["f32"][:6], bits(params["f32"])[:6])
    np.testing.assert_array_equal(got["f32"][6:], [0x00000000, 0x80000000, 0x7FC12345])
    # bfloat16: NaNs become the quiet NaN of their sign, subnormals flushed to zero.
    np.testing.assert_array_equal(got["bf16"][:3], bits(params["bf16"])[:3])
    np.testing.assert_array_equal(got["bf16"][3:], [0xFFC0, 0x7FC0, 0x7FC0, 0x0000, 0x8000])
    # float16: everything kept but the signalling NaN, quieted.
    np.testing.assert_array_equal(got["f16"], [*half_bits[:5], 0x7E01, *half_bits[6:]])
    # Float16 gradients reach adam as float32, so its float16 moments take float32 on both
    # branches; a skip returns their old values, exactly.
    assert new_state.inner_state[0].mu["f16"].dtype == jnp.float32
    as_before = jax.tree.map(
        lambda new, old: new.astype(old.dtype), new_state.inner_state, opt_state.inner_state
    )
    assert_bits_equal(as_before, opt_state.inner_state)


def test_a_skip_returns_the_inner_state_bit_for_bit_subnormals_and_signalling_nans_included():
    tx = jls.loss_scaled(optax.sgd(0.1, momentum=0.9), jls.DynamicLossScale())
    params = {"w": jnp.asarray(np.zeros(4, np.float32))}
    trace = {"w": _float32_bits(0x00000001, 0x80000001, 0x7F800001, 0x7FA00000)}
    opt_state = tx.init(params)
    opt_state = opt_state._replace(
        inner_state=(optax.TraceState(trace), *opt_state.inner_state[1:])
    )
    _, new_state = jax.jit(tx.update)({"w": jnp.full(4, jnp.nan)}, opt_state, params)
    assert_bits_equal(new_state.inner_state, opt_state.inner_state)


# --- 8. the Python version the package claims ----------------------------------------------


def _lower_bound(specifier: str) -> tuple[int, ...]:
    (version,) = re.findall(r">=\s*([\d.]+)", specifier)
    return tuple(int(part) for part in version.split("."))


def test_requires_python_ruff_target_and_readme_agree_with_the_dependencies():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    claimed = _lower_bound(pyproject["project"]["requires-python"])
    needed = max(
        _lower_bound(importlib.metadata.metadata(name)["Requires-Python"])
        for name in ("jax", "jaxlib", "optax")
    )
    # jax 0.10, the lowest the dependencies allow, needs 3.11; a newer jax installed (as pip
    # picks on Python 3.12) may need more, and an older interpreter then gets jax 0.10.
    assert claimed <= needed[:2]
    assert claimed == (3, 11)
    assert pyproject["tool"]["ruff"]["target-version"] == "py{}{}".format(*claimed)
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"Python >= (3\.\d+)", readme) == ["{}.{}".format(*claimed)]
