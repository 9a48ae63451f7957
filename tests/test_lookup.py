"""`get_loss_scale` and `get_loss_scale_stats` (`_lookup`): the state found wherever it sits in
an optax state, and the errors when it is absent or ambiguous."""

import dataclasses
import re
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls

from helpers import stats_tuple


def wrapper(initial: float) -> optax.GradientTransformationExtraArgs:
    return jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(initial_loss_scale=initial))


@pytest.mark.parametrize(
    "build",
    [
        lambda p: wrapper(64.0).init(p),
        lambda p: optax.chain(optax.clip(1.0), wrapper(64.0), optax.scale(2.0)).init(p),
        lambda p: optax.inject_hyperparams(
            lambda learning_rate: jls.loss_scaled(
                optax.sgd(learning_rate), jls.DynamicLossScale(initial_loss_scale=64.0)
            )
        )(learning_rate=0.1).init(p),
        lambda p: jls.loss_scaled(
            optax.inject_hyperparams(optax.adam)(learning_rate=0.1), jls.FixedLossScale(64.0)
        ).init(p),
        lambda p: optax.MultiSteps(wrapper(64.0), 4).init(p),
        lambda p: jls.loss_scaled(
            optax.MultiSteps(optax.sgd(0.1), 4), jls.FixedLossScale(64.0)
        ).init(p),
        lambda p: {"opt": (optax.adam(1e-3).init(p), [wrapper(64.0).init(p)]), "step": 3},
    ],
    ids=["root", "chain", "inject-outside", "inject-inside", "multisteps", "of-multisteps", "nest"],
)
def test_get_loss_scale_finds_the_state(build):
    opt_state = build({"w": jnp.zeros(3)})
    scale = jls.get_loss_scale(opt_state)
    assert scale.dtype == jnp.float32
    assert scale.shape == ()
    assert float(scale) == 64.0
    stats = jls.get_loss_scale_stats(opt_state)
    assert isinstance(stats, jls.LossScaleStats)
    assert stats_tuple(opt_state) == (64.0, 0, True)
    assert stats.skipped_steps.dtype == jnp.int32
    assert stats.last_step_applied.dtype == jnp.bool_


def test_get_loss_scale_reads_the_current_scale():
    tx = optax.chain(optax.scale(1.0), wrapper(64.0))
    params = {"w": jnp.zeros(3)}
    opt_state = tx.init(params)
    _, opt_state = tx.update({"w": jnp.array([1.0, jnp.nan, 1.0])}, opt_state, params)
    assert float(jls.get_loss_scale(opt_state)) == 32.0
    expected = {
        "loss_scale": jnp.array(32.0, jnp.float32),
        "grad_norm": jnp.array(jnp.nan, jnp.float32),
        "skipped_steps": jnp.array(1, jnp.int32),
        "nan_skipped_steps": jnp.array(1, jnp.int32),
        "inf_skipped_steps": jnp.array(0, jnp.int32),
        "spike_skipped_steps": jnp.array(0, jnp.int32),
        "consecutive_skipped_steps": jnp.array(1, jnp.int32),
        "last_step_applied": jnp.array(False),
    }
    stats = jls.get_loss_scale_stats(opt_state)._asdict()
    chex.assert_trees_all_equal(stats, expected, strict=True)
    assert not any(leaf.weak_type for leaf in stats.values())


@pytest.mark.parametrize("getter", [jls.get_loss_scale, jls.get_loss_scale_stats])
def test_get_loss_scale_absent(getter):
    opt_state = optax.adam(1e-3).init({"w": jnp.zeros(3)})
    message = (
        f"{getter.__name__}: opt_state (tuple) holds no LossScaledState; "
        "build the optimizer with jax_lossscale.loss_scaled(inner, loss_scale)"
    )
    with pytest.raises(LookupError, match=re.escape(message)):
        getter(opt_state)
    with pytest.raises(LookupError, match=r"opt_state \(dict\) holds no LossScaledState"):
        getter({"a": opt_state})


@pytest.mark.parametrize(
    ("build", "paths"),
    [
        (lambda p: optax.chain(wrapper(8.0), wrapper(16.0)).init(p), "[0], [1]"),
        (
            lambda p: {"x": wrapper(8.0).init(p), "y": {"z": wrapper(16.0).init(p)}},
            "['x'], ['y']['z']",
        ),
    ],
    ids=["chain", "dict"],
)
@pytest.mark.parametrize("getter", [jls.get_loss_scale, jls.get_loss_scale_stats])
def test_get_loss_scale_ambiguous(getter, build, paths):
    opt_state = build({"w": jnp.zeros(3)})
    message = (
        f"{getter.__name__}: opt_state holds 2 LossScaledStates (at {paths}); "
        "pass the part of the state that holds the one you mean"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        getter(opt_state)


def _named_tuple_fields(tree) -> list[str]:
    """Every field name of every NamedTuple in `tree`, once per node."""
    names = []

    def visit(node):
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            names.extend(node._fields)
            for child in node:
                visit(child)
        elif isinstance(node, tuple | list):
            for child in node:
                visit(child)

    visit(tree)
    return names


def test_optax_tree_get_finds_the_one_grad_norm_with_spike_windows_on():
    """optax's tree_get looks fields up by name: with spike windows on it found two
    `grad_norm`s (the stat and the window) and raised "Found multiple values"."""
    tx = optax.chain(
        optax.identity(),
        jls.loss_scaled(
            optax.adam(1e-3), jls.DynamicLossScale(initial_loss_scale=4.0),
            skip_grad_norm_above=100.0, skip_spike_sigmas=3.0, spike_window=4,
        ),
    )  # fmt: skip
    params = {"w": jnp.zeros(2)}
    opt_state = tx.init(params)
    _, opt_state = tx.update({"w": jnp.array([12.0, 16.0])}, opt_state, params, value=2.0)
    grad_norm = optax.tree_utils.tree_get(opt_state, "grad_norm")
    chex.assert_trees_all_equal(grad_norm, jnp.float32(5.0), strict=True)
    assert grad_norm is opt_state[1].stats.grad_norm
    windows = optax.tree_utils.tree_get(opt_state, "recent_grad_norms")
    assert windows.values.tolist() == [5.0, 0.0, 0.0, 0.0]
    losses = optax.tree_utils.tree_get(opt_state, "recent_losses")
    assert losses.values.tolist() == [2.0, 0.0, 0.0, 0.0]
    # No two fields of the wrapper's state share a name that a lookup by name would mix up
    # (RecentValues' own fields repeat, once per window).
    names = [
        name
        for name in _named_tuple_fields(opt_state[1])
        if name not in ("values", "filled", "next_index")
    ]
    assert len(names) == len(set(names)), sorted(names)


def test_a_scale_held_as_a_property_is_read_from_the_optimizer_and_named_in_nnx_state():
    """A custom loss scale whose state gives `loss_scale` as a property: read from the nnx
    Optimizer and its opt_state; `nnx.state(optimizer)` is a mapping of the fields alone,
    and its error said only "holds no float32 loss_scale"."""
    from flax import nnx

    class Log2State(NamedTuple):
        log2: jax.Array

        @property
        def loss_scale(self):
            return jnp.ldexp(jnp.float32(1), self.log2)

    @dataclasses.dataclass(frozen=True)
    class Log2Scale(jls.LossScale):
        def init(self):
            return Log2State(jnp.int32(10))

        def adjust(self, state, grads_finite):
            return Log2State(jnp.where(grads_finite, state.log2, state.log2 - 1)), grads_finite

        def get_config(self):
            return {}

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jls.loss_scaled(optax.sgd(0.1), Log2Scale()), wrt=nnx.Param)
    assert float(jls.get_loss_scale(optimizer)) == 1024.0
    assert float(jls.get_loss_scale(optimizer.opt_state)) == 1024.0
    message = (
        "get_loss_scale: the loss scale's state in opt_state (dict) holds no float32 "
        "loss_scale; a mapping of its fields (nnx.state(optimizer) gives one) has no "
        "loss_scale property: pass the Optimizer or its opt_state"
    )
    with pytest.raises(LookupError, match=f"^{re.escape(message)}$"):
        jls.get_loss_scale(nnx.state(optimizer))
