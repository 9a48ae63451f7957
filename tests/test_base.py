"""The `LossScale` protocol (`jax_lossscale/_base.py`): `adjust` is the one rule a subclass
writes, `update` the finite test then `adjust`; `update`, `scale` and `unscale` are final, and
`loss_scaled` makes its own check of the scaled gradients and calls `adjust`."""

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

from helpers import assert_bits_equal, compiled_reductions, device_array

# Scaled gradients of four steps: finite, +inf, NaN, finite; a leaf of each kind of size.
STEPS = [
    {"w": device_array([8.0, -16.0, 4.0]), "b": jnp.array(2.0)},
    {"w": device_array([8.0, np.inf, 4.0]), "b": jnp.array(2.0)},
    {"w": device_array([8.0, 1.0, 4.0]), "b": jnp.array(jnp.nan)},
    {"w": device_array([3.0, 5.0, -7.0]), "b": jnp.array(1.0)},
]
PARAMS = {"w": device_array([1.0, 2.0, 3.0]), "b": jnp.array(0.5)}


def _run(loss_scale, steps=STEPS, inner=None):
    """The updates, scales and gradient norms of a jitted loss-scaled sgd over `steps`."""
    tx = jls.loss_scaled(inner or optax.sgd(0.5, momentum=0.9), loss_scale)
    update = jax.jit(tx.update)
    opt_state, params = tx.init(PARAMS), PARAMS
    updates_seen, scales, norms = [], [], []
    for grads in steps:
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        updates_seen.append(updates)
        scales.append(float(jls.get_loss_scale(opt_state)))
        norms.append(float(jls.get_loss_scale_stats(opt_state).grad_norm))
    return updates_seen, scales, norms


@dataclasses.dataclass(frozen=True)
class FloorAtFourLossScale(jls.DynamicLossScale):
    """A user's subclass with a rule of its own: never backs off below 4."""

    def adjust(self, state, grads_finite):
        state, should_apply = super().adjust(state, grads_finite)
        return state._replace(loss_scale=jnp.maximum(state.loss_scale, 4.0)), should_apply


class HalvingState(NamedTuple):
    loss_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class HalvingLossScale(jls.LossScale):
    """The custom loss scale of docs/api.md, written against the protocol alone."""

    initial: float = 2.0**15

    def init(self):
        return HalvingState(jnp.asarray(self.initial, jnp.float32))

    def __call__(self, state):
        return state.loss_scale

    def adjust(self, state, grads_finite):
        halved = jnp.where(grads_finite, state.loss_scale, state.loss_scale / 2)
        return HalvingState(halved), grads_finite

    def get_config(self):
        return {"initial": self.initial}


def test_a_subclass_that_cannot_be_hashed_is_refused_saying_how_to_fix_it():
    """A plain (not frozen) dataclass has no hash: `ls(state)` and `tx.update` raised a bare
    `TypeError: unhashable type: 'Unfrozen'` from a cache inside the library."""

    @dataclasses.dataclass
    class Unfrozen(jls.LossScale):
        initial: float = 8.0

        def init(self):
            return HalvingState(jnp.asarray(self.initial, jnp.float32))

        def adjust(self, state, grads_finite):
            return state, grads_finite

        def get_config(self):
            return {"initial": self.initial}

    message = (
        "Unfrozen is not hashable: a LossScale holds hyperparameters only, and is hashed "
        "where jax.jit takes it as a static value; make it a frozen dataclass "
        "(@dataclasses.dataclass(frozen=True)) or define __hash__ and __eq__"
    )
    loss_scale = Unfrozen()
    for call in (
        lambda: loss_scale(HalvingState(jnp.float32(8.0))),
        lambda: jls.loss_scaled(optax.sgd(0.1), loss_scale),
    ):
        with pytest.raises(TypeError) as excinfo:
            call()
        assert str(excinfo.value) == message


@pytest.mark.parametrize("method", ["update", "scale", "unscale"])
def test_a_subclass_defining_a_final_method_is_refused_naming_adjust(method):
    """`update`, `scale` and `unscale` are final: defining one (as a subclass that logged in
    `update` did) is a TypeError when the class is created, whose message names `adjust`."""

    def defined(self, state, tree, axis_name=None):
        return getattr(super(type(self), self), method)(state, tree)

    with pytest.raises(TypeError) as excinfo:
        type("Logging", (jls.DynamicLossScale,), {method: defined})
    assert str(excinfo.value) == (
        f"Logging defines {method}, which LossScale keeps final: a loss scale writes its rule "
        "as adjust(state, grads_finite), which update calls after the finite test and "
        "loss_scaled calls after its own"
    )


@pytest.mark.parametrize(
    "inner", [optax.sgd(0.5, momentum=0.9), optax.adam(0.1)], ids=["sgd", "adam"]
)
def test_a_subclass_defining_adjust_trains_with_its_parents_bits_on_both_optimizers(inner):
    """A protocol-only subclass whose `adjust` adds to the parent's (a log here) gets the
    parent's updates, scales and norms bit for bit, under sgd (skipped by selects) and adam
    (skipped by a `cond`) alike; its `adjust` is what `loss_scaled` calls."""

    @dataclasses.dataclass(frozen=True)
    class LoggingAdjust(jls.DynamicLossScale):
        def adjust(self, state, grads_finite):
            ADJUSTED.append(type(grads_finite).__name__)
            return super().adjust(state, grads_finite)

    ADJUSTED.clear()
    ls = dict(initial_loss_scale=8.0, increment_period=1)
    parent = _run(jls.DynamicLossScale(**ls), inner=inner)
    logging = _run(LoggingAdjust(**ls), inner=inner)
    assert ADJUSTED  # called on the trace of the jitted update
    assert_bits_equal(logging[0], parent[0])
    assert logging[1] == parent[1] == [16.0, 8.0, 4.0, 8.0]
    assert_bits_equal(np.array(logging[2], np.float32), np.array(parent[2], np.float32))
    assert parent[2][0] == float(np.float32(np.sqrt(1.0 + 4.0 + 0.25 + 0.0625)))
    assert parent[2][1] == np.inf
    assert np.isnan(parent[2][2])
    assert_bits_equal(parent[0][1], {"w": jnp.full(3, -0.0), "b": jnp.array(-0.0)})


ADJUSTED: list[str] = []


def test_a_subclass_overriding_adjust_gets_its_rule_and_the_one_pass_check():
    """`loss_scaled` calls the subclass's `adjust`: the scale stops at 4 where the parent's
    goes down to 2; and it checks the scaled gradients in the same reductions as for the
    parent."""
    ls = dict(initial_loss_scale=8.0, increment_period=100)
    overflows = [{"w": jnp.full(3, jnp.inf), "b": jnp.array(1.0)}] * 3
    assert _run(FloorAtFourLossScale(**ls), overflows)[1] == [4.0, 4.0, 4.0]
    assert _run(jls.DynamicLossScale(**ls), overflows)[1] == [4.0, 2.0, 1.0]

    def reductions(loss_scale, inner):
        tx = jls.loss_scaled(inner, loss_scale)
        lowered = jax.jit(tx.update).lower(PARAMS, tx.init(PARAMS), PARAMS)
        return compiled_reductions(lowered.compile().as_text())

    for inner in (optax.sgd(0.5, momentum=0.9), optax.adam(0.1)):
        floor = reductions(FloorAtFourLossScale(**ls), inner)
        assert floor == reductions(jls.DynamicLossScale(**ls), inner)


def test_a_loss_scale_written_against_the_protocol_alone_works_with_loss_scaled():
    """The docs' custom loss scale: `init`, `__call__`, `adjust`, `get_config`. Its
    `update` comes from the base class; `loss_scaled` skips the two non-finite steps and
    halves the scale on each."""
    ls = HalvingLossScale(8.0)
    updates, scales, _ = _run(ls)
    assert scales == [8.0, 4.0, 2.0, 2.0]
    assert_bits_equal(updates[1], {"w": jnp.full(3, -0.0), "b": jnp.array(-0.0)})
    assert_bits_equal(updates[2], {"w": jnp.full(3, -0.0), "b": jnp.array(-0.0)})
    state, should_apply = ls.update(ls.init(), {"w": jnp.array([1.0, jnp.nan])})
    assert (bool(should_apply), float(ls(state))) == (False, 4.0)
    state, should_apply = ls.update(state, {"w": jnp.array([1.0, 2.0])})
    assert (bool(should_apply), float(ls(state))) == (True, 4.0)


def test_update_is_adjust_given_the_finite_flag():
    ls = jls.DynamicLossScale(initial_loss_scale=8.0, increment_period=2, hysteresis=2)
    by_update, by_adjust = ls.init(), ls.init()
    for grads in STEPS * 2:
        by_update, apply_u = ls.update(by_update, {"w": grads["w"] / 8, "b": grads["b"] / 8})
        by_adjust, apply_a = ls.adjust(by_adjust, jls.all_finite(grads))
        assert_bits_equal((by_update, apply_u), (by_adjust, apply_a))
    assert float(ls(by_update)) == 4.0  # T F F(backoff) T T(growth) F F(backoff) T


def test_a_loss_scale_defining_neither_adjust_nor_update_cannot_be_made():
    class Neither(jls.LossScale):
        def init(self):
            return HalvingState(jnp.float32(2.0))

        def __call__(self, state):
            return state.loss_scale

        def get_config(self):
            return {}

    with pytest.raises(TypeError, match=r"abstract method.*adjust"):
        Neither()


@pytest.mark.parametrize("ls", [jls.DynamicLossScale(), jls.FixedLossScale(2.0)])
@pytest.mark.parametrize("flag", [device_array([True], np.bool_), jnp.float32(1.0), "yes"])
def test_adjust_refuses_a_flag_that_is_not_a_bool_scalar(ls, flag):
    name = type(ls).__name__
    with pytest.raises(TypeError, match=rf"^{name}\.adjust\(grads_finite=.*must be a bool"):
        ls.adjust(ls.init(), flag)


def test_loss_scaled_names_adjust_when_it_returns_a_bad_should_apply():
    @dataclasses.dataclass(frozen=True)
    class FloatApply(HalvingLossScale):
        def adjust(self, state, grads_finite):
            return state, grads_finite.astype(jnp.float32)

    tx = jls.loss_scaled(optax.sgd(0.1), FloatApply())
    message = "loss_scaled: FloatApply.adjust must return should_apply as a bool scalar array"
    with pytest.raises(TypeError, match=re.escape(message)):
        tx.update(PARAMS, tx.init(PARAMS), PARAMS)


# --- the extension surface, as a subclass writes it ---------------------------------------


class _ScaleAndStep(NamedTuple):
    loss_scale: jax.Array
    step: jax.Array


def test_a_final_method_from_a_mixin_is_refused():
    """DESIGN: update, scale and unscale are final. A mixin placed before LossScale defined
    them unseen: scaled by 32 and unscaled by 16, silently."""

    class Mixin:
        def scale(self, state, tree):
            return tree * state.loss_scale * 4

    with pytest.raises(TypeError, match=r"^Mixed defines scale, which LossScale keeps final"):

        @dataclasses.dataclass(frozen=True, eq=False)
        class Mixed(Mixin, jls.DynamicLossScale):
            pass


def test_a_call_that_drifts_from_the_field_is_an_error_eagerly_and_the_field_when_traced():
    """A `__call__` that equals the field on the initial state only: after a step the loss was
    scaled by it and the gradients unscaled by the field (updates -3, -6, -9 where -3 is
    right). Eagerly it raises; traced, `ls(state)` is the field, and every update is -3."""

    @dataclasses.dataclass(frozen=True)
    class Drifting(jls.LossScale):
        def init(self):
            return _ScaleAndStep(jnp.float32(8.0), jnp.int32(0))

        def __call__(self, state):
            return state.loss_scale * (1 + state.step).astype(jnp.float32)

        def adjust(self, state, grads_finite):
            return state._replace(step=state.step + 1), grads_finite

        def get_config(self):
            return {}

    ls = Drifting()
    tx = jls.loss_scaled(optax.sgd(1.0), ls)
    params = {"w": jnp.ones(1)}

    @jax.jit
    def step(params, opt_state):
        scale = ls(opt_state.loss_scale_state)
        grads = jax.grad(lambda p: 3 * p["w"].sum() * scale)(params)
        return tx.update(grads, opt_state, params)

    opt_state = tx.init(params)
    for _ in range(3):
        updates, opt_state = step(params, opt_state)
        assert_bits_equal(updates["w"], jnp.array([-3.0]))
    with pytest.raises(TypeError) as excinfo:
        ls(opt_state.loss_scale_state)
    assert str(excinfo.value) == (
        "Drifting.__call__ returns 32.0 for a state whose loss_scale is 8.0; the loss is "
        "multiplied by loss_scale (get_loss_scale, value_and_grad) and the gradients divided "
        "by it, so __call__ must return state.loss_scale (or be left to LossScale)"
    )


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            lambda state: _ScaleAndStep(state.loss_scale.astype(jnp.float16), state.step),
            "loss_scaled: Broken.adjust: its new state.loss_scale must have dtype float32 (not "
            "weakly typed), got",
        ),
        (
            lambda state: (state.loss_scale, state.step),
            "loss_scaled: Broken.adjust: its new state must be the _ScaleAndStep returned by "
            "Broken.init()",
        ),
    ],
    ids=["float16-scale", "tuple"],
)
def test_a_state_that_adjust_breaks_is_an_error_naming_adjust(state, message):
    """Before: a float16 scale came back from the update ("float16 scales never appear") and
    the next step blamed its caller's state."""

    @dataclasses.dataclass(frozen=True)
    class Broken(jls.LossScale):
        def init(self):
            return _ScaleAndStep(jnp.float32(8.0), jnp.int32(0))

        def adjust(self, s, grads_finite):
            return state(s), grads_finite

        def get_config(self):
            return {}

    tx = jls.loss_scaled(optax.sgd(0.1), Broken())
    params = {"w": jnp.ones(1)}
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        tx.update(params, tx.init(params), params)
    with pytest.raises(TypeError, match=re.escape(message.replace("loss_scaled", "Broken.update"))):
        Broken().update(Broken().init(), params)


def test_a_subclass_of_fixed_loss_scale_round_trips_its_own_fields():
    @jls.register
    @dataclasses.dataclass(frozen=True)
    class WarmFixed(jls.FixedLossScale):
        warmup: int = 0

    ls = WarmFixed(8.0, warmup=100)
    assert ls.get_config() == {"loss_scale_value": 8.0, "warmup": 100}
    assert jls.deserialize(jls.serialize(ls)) == ls


def test_a_field_computed_after_init_stays_out_of_the_config():
    @jls.register
    @dataclasses.dataclass(frozen=True, eq=False)
    class Twice(jls.DynamicLossScale):
        twice: int = dataclasses.field(init=False, default=0)

        def __post_init__(self):
            super().__post_init__()
            object.__setattr__(self, "twice", 2 * self.increment_period)

    ls = Twice(increment_period=3)
    assert "twice" not in ls.get_config()
    assert jls.deserialize(jls.serialize(ls)).twice == 6


def test_a_state_array_init_reuses_is_the_wrappers_own_so_the_state_donates():
    """`init` returning one array in two fields, or a module constant: the first donated step
    failed ("donate the same buffer twice") or deleted the constant."""
    scale = jnp.float32(8.0)

    class Shared(NamedTuple):
        loss_scale: jax.Array
        good: jax.Array
        bad: jax.Array

    @dataclasses.dataclass(frozen=True)
    class Reusing(jls.LossScale):
        def init(self):
            zero = jnp.zeros((), jnp.int32)
            return Shared(scale, zero, zero)

        def adjust(self, state, grads_finite):
            return state._replace(good=state.good + 1), grads_finite

        def get_config(self):
            return {}

    tx = jls.loss_scaled(optax.sgd(0.1), Reusing())
    params = {"w": jnp.ones(1)}
    step = jax.jit(lambda opt_state: tx.update(params, opt_state, params)[1], donate_argnums=0)
    opt_state = step(step(tx.init(params)))
    assert int(opt_state.loss_scale_state.good) == 2
    assert not scale.is_deleted()


def test_a_weakly_typed_scale_from_init_is_refused_when_the_wrapper_is_built():
    """`jnp.asarray(8.0)` is weakly typed: taken, it was refused at the first `ls(state)` with
    advice to build the state with the `init` that made it."""

    class Held(NamedTuple):
        loss_scale: jax.Array

    @dataclasses.dataclass(frozen=True)
    class Weak(jls.LossScale):
        def init(self):
            return Held(jnp.asarray(8.0))

        def adjust(self, state, grads_finite):
            return state, grads_finite

        def get_config(self):
            return {}

    with pytest.raises(TypeError) as excinfo:
        jls.loss_scaled(optax.sgd(0.1), Weak())
    assert str(excinfo.value).endswith(
        "Weak.init() returns Held with loss_scale of dtype float32 and shape (), weakly typed "
        "(make it with jnp.float32(...))"
    )


def test_a_subclass_s_bad_hyperparameter_is_named_with_the_subclass():
    @dataclasses.dataclass(frozen=True, eq=False)
    class Capped(jls.DynamicLossScale):
        cap: float = 1e6

    @dataclasses.dataclass(frozen=True)
    class Floor(jls.FixedLossScale):
        pass

    with pytest.raises(ValueError, match=r"^Capped\(increment_period=0\): increment_period must"):
        Capped(increment_period=0)
    with pytest.raises(ValueError, match=r"^Floor\(loss_scale_value=0\.5\): loss_scale_value"):
        Floor(0.5)


def test_an_attribute_error_inside_a_subclass_s_property_names_what_is_missing():
    @dataclasses.dataclass(frozen=True)
    class Typo(jls.FixedLossScale):
        @property
        def doubled(self):
            return self.loss_scale_vlaue * 2

    with pytest.raises(AttributeError, match="'Typo' object has no attribute 'loss_scale_vlaue'"):
        _ = Typo(4.0).doubled


def _scale_of_a_state_built_in_jit(cls):
    """A jitted function building `loss_scaled` with `cls` from a traced initial scale."""

    @jax.jit
    def scale_of_a_fresh_state(initial):
        tx = jls.loss_scaled(optax.sgd(1.0), cls(initial_loss_scale=initial))
        return jls.get_loss_scale(tx.init({"w": jnp.ones(1)}))

    return scale_of_a_fresh_state


def test_a_subclass_re_deriving_eq_built_with_a_traced_scale_is_told_to_keep_eq_false():
    """`@dataclass(frozen=True)` writes a `__hash__` over every field, a traced scale too;
    the message said to make it a frozen dataclass, which it was."""

    @dataclasses.dataclass(frozen=True)
    class Capped(jls.DynamicLossScale):
        cap: float = 1e6

    with pytest.raises(TypeError) as excinfo:
        _scale_of_a_state_built_in_jit(Capped)(jnp.float32(64.0))
    assert str(excinfo.value).startswith(
        "Capped holds a traced initial_loss_scale, and a dataclass's own __hash__ and __eq__ "
        "cannot take it (jax.jit hashes a loss scale as a static value); keep those of "
        "DynamicLossScale, which leave traced values out: "
        "@dataclasses.dataclass(frozen=True, eq=False)"
    )

    @dataclasses.dataclass(frozen=True, eq=False)
    class Kept(jls.DynamicLossScale):
        cap: float = 1e6

    assert float(_scale_of_a_state_built_in_jit(Kept)(jnp.float32(64.0))) == 64.0
