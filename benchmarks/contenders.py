"""The train steps compared: the bare optimizer, jax_lossscale and the patterns of its peers.

Each contender is built for one inner optax optimizer and gives `init(params) -> state` and
two step functions, both `(params, state, ...) -> (params, state)`:

* `optimizer_step(params, state, grads)`: the optimizer step alone. The loss-scaled
  contenders receive the gradients of the scaled loss, the others the true gradients.
* `train_step(params, state, loss_fn, batch)`: the full step, differentiation included.

The peers are written the way their users write them: jmp's `DynamicLossScale` with
`all_finite` and `select_tree`, flax's `DynamicScale.value_and_grad` with a `jnp.where`
select, and optax's `apply_if_finite` (which skips but does not scale).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jax_lossscale as jls

LOSS_SCALE = 2.0**15  # every contender starts here; a power of two, so unscaling is exact


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str
    scales_loss: bool  # whether `optimizer_step` expects the gradients of the scaled loss
    init: Callable[[Any], Any]
    optimizer_step: Callable[..., tuple[Any, Any]]
    train_step: Callable[..., tuple[Any, Any]]


def bare(inner: optax.GradientTransformation) -> Contender:
    def optimizer_step(params, opt_state, grads):
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train_step(params, opt_state, loss_fn, batch):
        return optimizer_step(params, opt_state, jax.grad(loss_fn)(params, batch))

    return Contender("bare", False, inner.init, optimizer_step, train_step)


def jax_lossscale(inner: optax.GradientTransformation) -> Contender:
    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=LOSS_SCALE))

    def optimizer_step(params, opt_state, scaled_grads):
        updates, opt_state = tx.update(scaled_grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train_step(params, opt_state, loss_fn, batch):
        loss_scale = jls.get_loss_scale(opt_state)
        scaled_grads = jax.grad(lambda p: loss_fn(p, batch) * loss_scale)(params)
        return optimizer_step(params, opt_state, scaled_grads)

    return Contender("jax_lossscale", True, tx.init, optimizer_step, train_step)


def jmp_select(inner: optax.GradientTransformation) -> Contender:
    import jmp

    # jmp 0.0.4's DynamicLossScale cannot be a jit argument on current JAX, so the state
    # carries its arrays and the step rebuilds it.
    def init(params):
        return inner.init(params), (jnp.float32(LOSS_SCALE), jnp.int32(0))

    def rebuild(arrays):
        loss_scale, counter = arrays
        return jmp.DynamicLossScale(loss_scale, counter, period=2000, factor=2)

    def finish(params, state, loss_scale, scaled_grads):
        opt_state, _ = state
        grads = loss_scale.unscale(scaled_grads)
        grads_finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(grads_finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            grads_finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    def optimizer_step(params, state, scaled_grads):
        return finish(params, state, rebuild(state[1]), scaled_grads)

    def train_step(params, state, loss_fn, batch):
        loss_scale = rebuild(state[1])
        scaled_grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
        return finish(params, state, loss_scale, scaled_grads)

    return Contender("jmp", True, init, optimizer_step, train_step)


def flax_select(inner: optax.GradientTransformation) -> Contender:
    from flax.training.dynamic_scale import DynamicScale

    def init(params):
        return inner.init(params), DynamicScale(scale=LOSS_SCALE)

    def finish(params, opt_state, dynamic_scale, is_finite, grads):
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def select(new, old):
            return jax.tree.map(lambda a, b: jnp.where(is_finite, a, b), new, old)

        return select(new_params, params), (select(new_opt_state, opt_state), dynamic_scale)

    def optimizer_step(params, state, scaled_grads):
        # DynamicScale computes the gradients itself; this loss has `scaled_grads` as the
        # gradient of its scaled value, so the optimizer step is all that is measured.
        opt_state, dynamic_scale = state
        value_and_grad = dynamic_scale.value_and_grad(_loss_with_gradient)
        dynamic_scale, is_finite, _, grads = value_and_grad(params, scaled_grads)
        return finish(params, opt_state, dynamic_scale, is_finite, grads)

    def train_step(params, state, loss_fn, batch):
        opt_state, dynamic_scale = state
        dynamic_scale, is_finite, _, grads = dynamic_scale.value_and_grad(loss_fn)(params, batch)
        return finish(params, opt_state, dynamic_scale, is_finite, grads)

    return Contender("flax", True, init, optimizer_step, train_step)


def apply_if_finite(inner: optax.GradientTransformation) -> Contender:
    tx = optax.apply_if_finite(inner, max_consecutive_errors=5)
    contender = bare(tx)
    return dataclasses.replace(contender, name="optax.apply_if_finite")


@jax.custom_vjp
def _loss_with_gradient(params, gradient):
    del params, gradient
    return jnp.float32(0.0)


def _loss_with_gradient_fwd(params, gradient):
    return jnp.float32(0.0), gradient


def _loss_with_gradient_bwd(gradient, cotangent):
    del cotangent
    return gradient, jax.tree.map(jnp.zeros_like, gradient)


_loss_with_gradient.defvjp(_loss_with_gradient_fwd, _loss_with_gradient_bwd)

ALL = (bare, jax_lossscale, jmp_select, flax_select, apply_if_finite)
