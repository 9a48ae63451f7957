"""Overflow diagnostics: `count_non_finite` and `non_finite_paths` name the leaves that hold NaN
or inf, their counts saturate, and `check_not_stuck` says when a run keeps skipping."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale._counters import count_true

from helpers import assert_bits_equal, device_array, stats_dict


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


# --- which leaves overflowed ---------------------------------------------------------------


def mixed_tree():
    nan, inf = np.nan, np.inf
    return {
        "encoder": {
            "layers": [
                {"kernel": device_array([[1.0, nan], [inf, -inf]]), "bias": None},
                {
                    "kernel": device_array(np.zeros((2, 2))),
                    "bias": device_array([1.0, 2.0], np.float16),
                },
            ],
            "steps": device_array([3, 4], np.int32),
        },
        "head": (
            device_array([inf, 1.0, nan], jnp.bfloat16),
            device_array([True, False], bool),
            device_array([1 + 1j, complex(nan, 0.0), complex(1.0, -inf)], np.complex64),
        ),
        "scale": device_array(inf, np.float16),
        "unused": None,
    }


def expected_counts():
    def count(n):
        return jnp.asarray(n, jnp.int32)

    return {
        "encoder": {
            "layers": [
                {"kernel": count(3), "bias": None},
                {"kernel": count(0), "bias": count(0)},
            ],
            "steps": count(0),
        },
        "head": (count(2), count(0), count(2)),
        "scale": count(1),
        "unused": None,
    }


def test_count_non_finite_counts_each_leaf(jit_or_eager):
    counts = jit_or_eager(jls.count_non_finite, mixed_tree())
    chex.assert_trees_all_equal(counts, expected_counts(), strict=True)
    assert counts["unused"] is None
    assert counts["encoder"]["layers"][0]["bias"] is None


def test_non_finite_paths_names_the_leaves_in_order(jit_or_eager):
    counts = jit_or_eager(jls.count_non_finite, mixed_tree())
    paths = jls.non_finite_paths(counts)
    assert list(paths.items()) == [
        ("encoder/layers/0/kernel", 3),
        ("head/0", 2),
        ("head/2", 2),
        ("scale", 1),
    ]


def test_non_finite_paths_is_empty_when_all_is_finite(jit_or_eager):
    # Built on the host (no program compiled) but for the weakly typed scalar.
    w, b = jnp.asarray(np.ones((2, 3), np.float32)), jnp.asarray(np.zeros(2, jnp.bfloat16))
    tree = {"w": w, "b": [b, None], "n": jnp.array(7)}
    counts = jit_or_eager(jls.count_non_finite, tree)
    assert jls.non_finite_paths(counts) == {}
    assert jls.non_finite_paths(jls.count_non_finite({})) == {}


def test_non_finite_paths_of_a_single_leaf_names_the_root():
    assert jls.non_finite_paths(jls.count_non_finite(jnp.array([jnp.nan, 1.0]))) == {"<root>": 1}


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        (
            {"w": jnp.array(1.0)},
            "non_finite_paths: counts leaf at ['w'] is array(1., dtype=float32); "
            "pass the tree returned by count_non_finite",
        ),
        (
            {"grads": {"w": device_array(np.ones(3))}},
            "non_finite_paths: counts leaf at ['grads']['w'] is "
            "array([1., 1., 1.], dtype=float32); pass the tree returned by count_non_finite",
        ),
        (
            1.5,
            "non_finite_paths: counts leaf at <root> is 1.5; "
            "pass the tree returned by count_non_finite",
        ),
    ],
    ids=["float-scalar", "gradients", "python-float"],
)
def test_non_finite_paths_refuses_what_is_not_counts(counts, message):
    with pytest.raises(TypeError, match=exact(message)):
        jls.non_finite_paths(counts)


def test_non_finite_paths_sums_counts_over_devices():
    w = np.zeros((8, 3), np.float32)  # built on the host: no program compiled
    w[2, 0], w[5] = np.inf, np.nan
    grads = {"b": jnp.asarray(np.zeros((8, 2), np.float32)), "w": jnp.asarray(w)}
    counts = jax.pmap(jls.count_non_finite)(grads)
    chex.assert_trees_all_equal(
        counts, {"b": np.zeros(8, np.int32), "w": np.array([0, 0, 1, 0, 0, 3, 0, 0], np.int32)}
    )
    assert jls.non_finite_paths(counts) == {"w": 4}


def test_count_non_finite_names_a_string_leaf():
    message = (
        "count_non_finite: tree leaf at ['a'][1]['name'] has type str ('dense'); "
        "every leaf must be a JAX or NumPy array (or None)"
    )
    with pytest.raises(TypeError, match=exact(message)):
        jls.count_non_finite({"a": [jnp.ones(2), {"name": "dense"}]})


def test_train_step_reports_the_overflowing_layer():
    ls = jls.DynamicLossScale(initial_loss_scale=2.0**13, increment_period=100)
    tx = jls.loss_scaled(optax.sgd(0.1), ls)
    params = {"layers": [{"w": jnp.ones(4)}, {"w": jnp.ones(4)}]}
    inputs = [jnp.full(4, 1.0), jnp.full(4, 10.0)]

    def loss_fn(params):
        # Half-precision compute: the gradient of layer 1 is scale * 10, over the
        # float16 maximum at a scale of 2**13 but not at 2**12.
        terms = [
            jnp.sum(layer["w"].astype(jnp.float16) * x.astype(jnp.float16))
            for layer, x in zip(params["layers"], inputs, strict=True)
        ]
        return sum(terms).astype(jnp.float32)

    @jax.jit
    def train_step(params, opt_state):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_fn(p) * scale)(params)
        counts = jls.count_non_finite(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, counts

    opt_state = tx.init(params)
    new_params, opt_state, counts = train_step(params, opt_state)
    assert jls.non_finite_paths(counts) == {"layers/1/w": 4}
    assert_bits_equal(new_params, params)
    assert stats_dict(opt_state)["inf_skipped_steps"] == 1
    assert jls.get_loss_scale(opt_state).item() == 2.0**12

    new_params, opt_state, counts = train_step(params, opt_state)
    assert jls.non_finite_paths(counts) == {}
    one, tenth = np.float32(1.0), np.float32(0.1)
    chex.assert_trees_all_equal(
        new_params,
        {"layers": [{"w": np.full(4, one - tenth)}, {"w": np.full(4, one - tenth * 10)}]},
    )
    assert stats_dict(opt_state)["last_step_applied"] is True


# --- counts saturate -----------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "chunk", "expected"),
    [(10, 3, 10), (10, 4, 10), (12, 4, 12), (5, 8, 5), (0, 4, 0)],
)
def test_count_true_in_chunks_counts_exactly_below_the_limit(size, chunk, expected):
    assert int(jax.jit(count_true, static_argnums=1)(np.ones(size, bool), chunk)) == expected


def test_count_non_finite_saturates_past_int32_max():
    # 2**31 + 5 entries, all inf: an int32 sum would wrap to -2**31 + 5. Made and counted in
    # one jit, the leaf is never written out (2 GB eagerly, and five times the time).
    counts = jax.jit(
        lambda: jls.count_non_finite(
            {
                "big": jnp.full(2**31 + 5, jnp.inf, jnp.float8_e5m2),
                "small": jnp.array([1.0, jnp.nan]),
            }
        )
    )()
    chex.assert_trees_all_equal(
        counts, {"big": jnp.int32(2**31 - 1), "small": jnp.int32(1)}, strict=True
    )


# --- stuck runs -------------------------------------------------------------------------------


def _stuck_run(steps, bad_steps, loss_scale=None):
    """A donated, jitted step run `steps` times; the gradient of `w` is NaN on `bad_steps`."""
    tx = jls.loss_scaled(optax.sgd(0.1), loss_scale or jls.DynamicLossScale(2.0**3))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, bad):
        grads = {"b": jnp.ones(2), "w": jnp.where(bad, jnp.nan, 1.0) * jnp.ones(3)}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jls.count_non_finite(grads)

    params = {"b": jnp.zeros(2), "w": jnp.zeros(3)}
    opt_state = tx.init(params)
    for step in range(steps):
        params, opt_state, counts = train_step(params, opt_state, step in bad_steps)
    return opt_state, counts


_STUCK_FIVE = (
    "loss_scaled is stuck: 5 steps in a row were skipped, at least max_consecutive_skips=5, "
    "at a loss scale of 1.0; skipped so far: 5 for NaN, 0 for inf, 0 as spikes"
)
_ADVICE = (
    "; they are not finite whatever the scale (a NaN or an infinity, or a grad_norm above about "
    "1.8e19, whose square overflows float32): find the op that overflows (count_non_finite on "
    "the gradients, jax_debug_nans on the forward pass) and compute it in float32, lower the "
    "learning rate, or restore a checkpoint from before"
)


def test_check_not_stuck_raises_naming_the_scale_the_counts_and_the_leaves():
    opt_state, counts = _stuck_run(6, bad_steps={1, 2, 3, 4, 5})
    assert jls.check_not_stuck(opt_state, 6, non_finite_counts=counts) is None
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 5, non_finite_counts=counts)
    assert str(excinfo.value) == (
        _STUCK_FIVE + "; the last step's gradients held NaN or inf in w: 3 entries" + _ADVICE
    )
    assert isinstance(excinfo.value, FloatingPointError)
    assert repr(excinfo.type) == "<class 'jax_lossscale.LossScaleStuckError'>"
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 5)  # no counts: no leaves named
    assert str(excinfo.value) == _STUCK_FIVE + _ADVICE


def test_check_not_stuck_says_when_finite_gradients_overflow_their_squared_norm():
    """DESIGN 3.1: finite gradients of 3e19, whose squares overflow float32, are an overflow
    at every step and every scale; with the counts, which name no leaf, the message says so
    and what to look at, rather than to look for a NaN or an infinity."""
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(initial_loss_scale=4.0))
    params = {"w": jnp.zeros(3)}
    opt_state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(4):
        grads = {"w": jnp.full(3, 3e19) * jls.get_loss_scale(opt_state)}
        _, opt_state = update(grads, opt_state, params)
    counts = jls.count_non_finite(grads)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 4, non_finite_counts=counts)
    assert str(excinfo.value) == (
        "loss_scaled is stuck: 4 steps in a row were skipped, at least max_consecutive_skips=4, "
        "at a loss scale of 1.0; skipped so far: 0 for NaN, 4 for inf, 0 as spikes; the last "
        "step's gradients held NaN or inf in no leaf; every entry was finite, but their squares "
        "added up past the float32 maximum (a grad_norm above about 1.8e19), which loss_scaled "
        "counts as an overflow on every platform: the unscaled gradients are that large "
        "whatever the scale; find the leaves whose norms are largest (optax.tree.norm of each), "
        "and scale the loss down, lower the learning rate, or restore a checkpoint from before"
    )


_FP8_ADVICE = (
    "; the gradients hold fp8 meta state ('_overwrite_with_gradient'): flax's "
    "Fp8DirectDotGeneralOp with dtype=float16 overflows float16 in its matmuls once its scales "
    "are set, at every loss scale; give those layers dtype=jnp.bfloat16 or jnp.float32"
)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_check_not_stuck_names_the_float16_fp8_layer_that_overflows():
    from flax import linen as nn
    from flax.linen import fp8_ops

    class MLP(nn.Module):
        dtype: object

        @nn.compact
        def __call__(self, x):
            dot = fp8_ops.Fp8DirectDotGeneralOp
            x = nn.Dense(16, dtype=self.dtype, dot_general_cls=dot)(x)
            return nn.Dense(1, dtype=self.dtype, dot_general_cls=dot)(nn.relu(x))

    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jnp.sum(x, axis=1, keepdims=True)
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(2.0**4))

    def run(dtype):
        model = MLP(dtype)

        def loss(variables):
            return jnp.mean((model.apply(variables, x).astype(jnp.float32) - y) ** 2)

        @jax.jit
        def step(variables, opt_state):
            _, grads = jls.value_and_grad(loss, opt_state)(variables)
            updates, opt_state = tx.update(grads, opt_state, variables)
            return optax.apply_updates(variables, updates), opt_state, jls.count_non_finite(grads)

        variables = jax.jit(model.init)(jax.random.key(0), x)  # one program, not op by op
        opt_state = tx.init(variables)
        for _ in range(8):
            variables, opt_state, counts = step(variables, opt_state)
        return opt_state, counts

    # float16: the loss stays finite, every step after the first is skipped, down to a scale of 1.
    opt_state, counts = run(jnp.float16)
    assert int(jls.get_loss_scale_stats(opt_state).consecutive_skipped_steps) == 7
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 7, non_finite_counts=counts)
    assert str(excinfo.value).endswith(_ADVICE + _FP8_ADVICE)
    assert "at a loss scale of 1.0" in str(excinfo.value)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 7)  # no counts: nothing says the tree holds fp8 state
    assert str(excinfo.value).endswith(_ADVICE)
    # bfloat16, as the message advises: no step skipped.
    opt_state, _ = run(jnp.bfloat16)
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 0


_META_ADVICE = (
    "; the gradients were finite (a grad_norm of {norm!r}), but new fp8 meta values were not, "
    "whatever the scale: an inf or NaN reached those layers (fp8 casts saturate, so the loss "
    "stayed finite); find where it enters them, in the data or the op before (jax_debug_nans "
    "on the forward pass), and compute that in float32"
)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("case", "advice"),
    [
        ("inf in the inputs", "meta"),
        ("a spike, then inf inputs", "meta"),
        ("inf param gradient", "plain"),
    ],
)
def test_check_not_stuck_on_float32_fp8_layers_says_what_overflowed(case, advice):
    """float32 fp8 layers: an inf in the data makes the input's amax inf and nothing else (the
    gradients stay finite); a plain param whose gradient is inf (a temperature of 0 under a
    square root) is no fp8 matter. Before: both were given the float16 fp8 advice, whose
    layers here are float32, and after an earlier spike the first was told to raise the spike
    bound."""
    variables, opt_state, step = _float32_fp8_run()
    x, y = _FP8_BATCH
    if case == "a spike, then inf inputs":
        variables, opt_state, _ = step(variables, opt_state, x, y * 1e6)
    if case == "inf param gradient":
        variables = {**variables, "params": {**variables["params"], "temperature": 0.0}}
    else:
        x = x.at[0, 0].set(jnp.inf)
    for _ in range(6):
        variables, opt_state, counts = step(variables, opt_state, x, y)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 6, non_finite_counts=counts)
    message = str(excinfo.value)
    if advice == "meta":
        norm = float(jls.get_loss_scale_stats(opt_state).grad_norm)
        assert list(jls.non_finite_paths(counts)) == [
            "_overwrite_with_gradient/Dense_0/Fp8DirectDotGeneralOp_0/input_amax_history"
        ]
        assert message.endswith(_META_ADVICE.format(norm=norm)), message
    else:
        assert list(jls.non_finite_paths(counts)) == ["params/temperature"]
        assert message.endswith(_ADVICE), message


_FP8_BATCH = (
    jax.random.normal(jax.random.key(1), (16, 8)),
    jnp.sum(jax.random.normal(jax.random.key(1), (16, 8)), axis=1, keepdims=True),
)


@functools.cache
def _float32_fp8_run():
    """A float32 MLP of flax's fp8 layers with a `temperature` param, and its jitted step."""
    from flax import linen as nn
    from flax.linen import fp8_ops

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            temperature = self.param("temperature", lambda key: jnp.float32(1.0))
            x = nn.Dense(8, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(x)
            out = nn.Dense(1, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(nn.relu(x))
            return out * jnp.sqrt(temperature)

    model = MLP()
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(2.0**4), skip_grad_norm_above=1e4)

    @jax.jit
    def step(variables, opt_state, x, y):
        loss = lambda v: jnp.mean((model.apply(v, x) - y) ** 2)  # noqa: E731
        _, grads = jls.value_and_grad(loss, opt_state)(variables)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state, jls.count_non_finite(grads)

    variables = jax.jit(model.init)(jax.random.key(0), _FP8_BATCH[0])
    return variables, tx.init(variables), step


def test_check_not_stuck_warns_and_goes_on_when_asked():
    opt_state, counts = _stuck_run(6, bad_steps={1, 2, 3, 4, 5})
    with pytest.warns(RuntimeWarning, match="^loss_scaled is stuck: 5 steps in a row") as record:
        message = jls.check_not_stuck(opt_state, 5, non_finite_counts=counts, on_stuck="warn")
    assert message == str(record[0].message)
    assert message.startswith(_STUCK_FIVE)


def test_an_applied_step_unsticks_the_run():
    opt_state, _ = _stuck_run(7, bad_steps={0, 1, 2, 3, 4})  # steps 5 and 6 applied
    stats = jls.get_loss_scale_stats(opt_state)
    assert (int(stats.skipped_steps), int(stats.consecutive_skipped_steps)) == (5, 0)
    assert jls.check_not_stuck(opt_state, 1) is None


def test_check_not_stuck_reads_a_state_replicated_by_pmap():
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(2.0), axis_name="i")
    devices = jax.local_device_count()
    params = {"w": jnp.zeros((devices, 2))}

    @functools.partial(jax.pmap, axis_name="i")
    def train_step(params, opt_state, g):
        updates, opt_state = tx.update({"w": g}, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.pmap(tx.init)(params)
    grads = np.ones((devices, 2), np.float32)  # built on the host: no program compiled
    grads[0, 0] = np.inf  # one device overflows
    grads = jnp.asarray(grads)
    for _ in range(3):
        params, opt_state = train_step(params, opt_state, grads)
    with pytest.raises(jls.LossScaleStuckError, match=r"3 steps in a row.* 0 for NaN, 3 for inf"):
        jls.check_not_stuck(opt_state, 3)


def test_check_not_stuck_bad_input():
    opt_state, _ = _stuck_run(1, bad_steps=set())
    with pytest.raises(ValueError, match=r"^check_not_stuck\(max_consecutive_skips=0\)") as excinfo:
        jls.check_not_stuck(opt_state, 0)
    assert str(excinfo.value) == (
        "check_not_stuck(max_consecutive_skips=0): max_consecutive_skips must be an integer "
        ">= 1 and <= 2147483647"
    )
    with pytest.raises(TypeError, match=r"^check_not_stuck\(max_consecutive_skips=2.5\)"):
        jls.check_not_stuck(opt_state, 2.5)
    with pytest.raises(ValueError, match=r"^check_not_stuck\(on_stuck='ignore'\)") as excinfo:
        jls.check_not_stuck(opt_state, 3, on_stuck="ignore")
    assert str(excinfo.value) == (
        "check_not_stuck(on_stuck='ignore'): on_stuck must be 'raise' or 'warn'"
    )
    with pytest.raises(LookupError, match="holds no LossScaledState"):
        jls.check_not_stuck(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


_SPIKE_ADVICE = (
    "; the last step was skipped as a spike, with finite gradients and a grad_norm of 1.5; a "
    "norm above skip_grad_norm_above at every step is a new level, not a bad batch: raise the "
    "bound, or leave the judging to skip_spike_sigmas, whose window follows a new level after "
    "spike_window // 4 spikes in a row; a loss given as value= that is not finite is a spike at "
    "every step: find the op that makes it with jax_debug_nans on the forward pass"
)


def _norm_run(tx, norms):
    """Steps whose true gradient is `[norm, 0]`, scaled by the state's scale."""
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    step = jax.jit(tx.update)
    for norm in norms:
        scale = np.float32(jls.get_loss_scale(opt_state))  # scaled on the host: no program
        _, opt_state = step({"w": np.array([norm, 0.0], np.float32) * scale}, opt_state, params)
    return opt_state


def test_a_run_stalled_on_spikes_gets_advice_of_its_own():
    """The norm moves from 1.0 to 1.5 for good, above skip_grad_norm_above=1.25: every step
    is a spike, and the advice is not the overflow's."""
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.FixedLossScale(1.0), skip_grad_norm_above=1.25,
        skip_spike_sigmas=4.0, spike_window=16,
    )  # fmt: skip
    opt_state = _norm_run(tx, [1.0] * 16 + [1.5] * 150)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 100)
    assert str(excinfo.value) == (
        "loss_scaled is stuck: 150 steps in a row were skipped, at least "
        "max_consecutive_skips=100, at a loss scale of 1.0; skipped so far: 0 for NaN, 0 for "
        "inf, 150 as spikes" + _SPIKE_ADVICE
    )
    assert "whatever the scale" not in str(excinfo.value)


def test_the_advice_follows_the_last_step_not_the_runs_totals():
    """30 spikes early in the run, then a NaN at every step: the whole-run spike count (32)
    was above the streak (22), so the NaN stall got the spike advice. And the other way
    round: a spike stall after as many NaN skips gets the spike advice."""
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(1.0, min_loss_scale=1.0), skip_grad_norm_above=1.0
    )
    opt_state = _norm_run(tx, [5.0] * 30 + [0.5] + [5.0] * 2 + [np.nan] * 20)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 20)
    assert str(excinfo.value) == (
        "loss_scaled is stuck: 22 steps in a row were skipped, at least max_consecutive_skips=20, "
        "at a loss scale of 1.0; skipped so far: 20 for NaN, 0 for inf, 32 as spikes" + _ADVICE
    )
    opt_state = _norm_run(tx, [np.nan] * 30 + [0.5] + [np.nan] * 2 + [5.0] * 20)
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 20)
    assert str(excinfo.value) == (
        "loss_scaled is stuck: 22 steps in a row were skipped, at least max_consecutive_skips=20, "
        "at a loss scale of 1.0; skipped so far: 32 for NaN, 0 for inf, 20 as spikes"
        + _SPIKE_ADVICE.replace("grad_norm of 1.5", "grad_norm of 5.0")
    )


def test_the_window_alone_no_longer_stalls_but_its_spikes_are_named_as_such():
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(2.0**4), skip_spike_sigmas=4.0, spike_window=16
    )
    assert jls.check_not_stuck(_norm_run(tx, [1.0] * 16 + [1.5] * 150), 100) is None
    opt_state = _norm_run(tx, [1.0] * 16 + [1.5] * 4)  # the four spikes before the window follows
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, 4)
    assert str(excinfo.value) == (
        "loss_scaled is stuck: 4 steps in a row were skipped, at least max_consecutive_skips=4, "
        "at a loss scale of 16.0; skipped so far: 0 for NaN, 0 for inf, 4 as spikes" + _SPIKE_ADVICE
    )


@pytest.mark.parametrize(
    "count",
    [jnp.int32(5), np.int64(5), np.array(5, np.int16), jnp.array(5, jnp.uint8)],
    ids=["jnp.int32", "np.int64", "np.ndarray", "uint8"],
)
def test_check_not_stuck_takes_a_concrete_integer_array_as_the_count(count):
    opt_state, _ = _stuck_run(6, bad_steps={1, 2, 3, 4, 5})
    with pytest.raises(jls.LossScaleStuckError) as excinfo:
        jls.check_not_stuck(opt_state, count)
    assert str(excinfo.value) == _STUCK_FIVE + _ADVICE
    assert jls.check_not_stuck(opt_state, count + 1) is None


def test_check_not_stuck_refuses_a_float_a_vector_or_a_traced_count_naming_it():
    opt_state, _ = _stuck_run(6, bad_steps={1, 2, 3, 4, 5})
    with pytest.raises(TypeError) as excinfo:
        jls.check_not_stuck(opt_state, jnp.float32(5.0))
    assert str(excinfo.value) == (
        "check_not_stuck(max_consecutive_skips=Array(5., dtype=float32)): max_consecutive_skips "
        "must be an integer >= 1, got ArrayImpl of dtype float32 and shape ()"
    )
    with pytest.raises(TypeError, match=r"got ArrayImpl of dtype int32 and shape \(1,\)$"):
        jls.check_not_stuck(opt_state, jnp.array([5]))
    with pytest.raises(TypeError, match=r"must be an integer >= 1$"):
        jls.check_not_stuck(opt_state, np.bool_(True))
    with pytest.raises(ValueError, match="must be an integer >= 1") as excinfo:
        jls.check_not_stuck(opt_state, jnp.int32(0))
    assert str(excinfo.value) == (
        "check_not_stuck(max_consecutive_skips=Array(0, dtype=int32)): max_consecutive_skips "
        "must be an integer >= 1 and <= 2147483647"
    )

    @jax.jit
    def traced(count):
        jls.check_not_stuck(opt_state, count)

    with pytest.raises(TypeError) as excinfo:
        traced(jnp.int32(5))
    assert str(excinfo.value) == (
        "check_not_stuck(max_consecutive_skips=JitTracer(int32[])): max_consecutive_skips must "
        "be a concrete integer, not a traced value: call check_not_stuck on the host, outside "
        "jit, between steps"
    )
