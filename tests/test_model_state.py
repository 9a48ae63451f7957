"""`where_applied`: model state (BatchNorm's running statistics) kept on a skipped step.

Each framework's recipe, as the integrations page shows it, is fed a batch with an inf
pixel: the forward pass turns the running statistics non-finite, the step is skipped, and
the statistics kept are the ones from before the batch, bit for bit.
"""

import functools

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_lossscale as jls

from helpers import assert_bits_equal


@functools.cache
def _batch():
    """X, Y and X_INF: jax's random values, made at the first test that needs them, not at
    import."""
    x = jax.random.normal(jax.random.key(0), (16, 4))
    x_inf = np.array(x)  # set on the host: no program compiled
    x_inf[3, 1] = np.inf  # one bad pixel
    return x, jnp.sum(x, axis=1, keepdims=True), jnp.asarray(x_inf)


def _tx():
    return jls.loss_scaled(optax.sgd(0.1, momentum=0.9), jls.DynamicLossScale(2.0**10))


def _copies(tree):
    return jax.tree.map(np.array, tree)


def _finite(tree):
    return all(bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


def test_haiku_style_state_dict_is_kept_on_a_skipped_step():
    """A hand-written BatchNorm whose state is a dict, as haiku's `hk.State` is."""
    X, Y, X_INF = _batch()

    def forward(params, state, x):
        h = x @ params["w"]
        mean, var = jnp.mean(h, axis=0), jnp.var(h, axis=0)
        new_state = {
            "batch_norm": {
                "mean": 0.9 * state["batch_norm"]["mean"] + 0.1 * mean,
                "var": 0.9 * state["batch_norm"]["var"] + 0.1 * var,
            }
        }
        out = ((h - mean) / jnp.sqrt(var + 1e-5)) @ params["v"]
        return out, new_state

    tx = _tx()

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, state, opt_state, x, y):
        def loss_fn(params):
            out, new_state = forward(params, state, x)
            return jnp.mean((out - y) ** 2) * jls.get_loss_scale(opt_state), new_state

        grads, new_state = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        kept = jls.where_applied(opt_state, new_state, state)
        return optax.apply_updates(params, updates), kept, opt_state, new_state

    params = {"w": jnp.full((4, 8), 0.1), "v": jnp.full((8, 1), 0.1)}
    state = {"batch_norm": {"mean": jnp.zeros(8), "var": jnp.ones(8)}}
    opt_state = tx.init(params)
    params, state, opt_state, _ = train_step(params, state, opt_state, X, Y)
    assert bool(jls.get_loss_scale_stats(opt_state).last_step_applied)
    var = np.asarray(state["batch_norm"]["var"])  # read on the host: no program compiled
    assert float(var[0]) != 1.0  # an applied step takes the new state
    before = _copies((params, state))
    params, state, opt_state, unkept = train_step(params, state, opt_state, X_INF, Y)
    assert not _finite(unkept)  # what the step would have kept without where_applied
    assert_bits_equal((params, state), before)
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(x)


def test_flax_linen_batch_stats_are_kept_on_a_skipped_step():
    X, Y, X_INF = _batch()
    net, tx = _LinenNet(), _tx()
    variables = jax.jit(net.init, static_argnames="train")(jax.random.key(1), X, train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, batch_stats, opt_state, x, y):
        def loss_fn(params):
            out, mutated = net.apply(
                {"params": params, "batch_stats": batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            loss = jnp.mean((out - y) ** 2)
            return loss * jls.get_loss_scale(opt_state), mutated["batch_stats"]

        grads, new_stats = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        kept = jls.where_applied(opt_state, new_stats, batch_stats)
        return optax.apply_updates(params, updates), kept, opt_state, new_stats

    params, batch_stats, opt_state, _ = train_step(params, batch_stats, opt_state, X, Y)
    before = _copies((params, batch_stats))
    params, batch_stats, opt_state, unkept = train_step(params, batch_stats, opt_state, X_INF, Y)
    assert not _finite(unkept)
    assert_bits_equal((params, batch_stats), before)
    assert (
        int(jls.get_loss_scale_stats(opt_state).inf_skipped_steps)
        + int(jls.get_loss_scale_stats(opt_state).nan_skipped_steps)
        == 1
    )
    params, batch_stats, opt_state, new_stats = train_step(params, batch_stats, opt_state, X, Y)
    chex.assert_trees_all_equal(batch_stats, new_stats)  # applied again: the new statistics


class _NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.batch_norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.batch_norm(self.dense(x)))


def test_flax_nnx_batch_stat_variables_are_kept_on_a_skipped_step():
    X, Y, X_INF = _batch()
    model = _NnxNet(nnx.Rngs(2))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, x, y):
        # nnx.state gives the live variables, which the forward pass changes: copy them.
        old_stats = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
        scale = jls.get_loss_scale(optimizer)
        grads = nnx.grad(lambda model: jnp.mean((model(x) - y) ** 2) * scale)(model)
        optimizer.update(model, grads)
        new_stats = nnx.state(model, nnx.BatchStat)
        unkept = jax.tree.map(jnp.copy, new_stats)
        nnx.update(model, jls.where_applied(optimizer, new_stats, old_stats))
        return unkept

    train_step(model, optimizer, X, Y)
    before = _copies(nnx.state(model, nnx.Param)), _copies(nnx.state(model, nnx.BatchStat))
    unkept = train_step(model, optimizer, X_INF, Y)
    assert not _finite(unkept)
    after = nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)
    assert_bits_equal(after, before)
    assert int(jls.get_loss_scale_stats(optimizer).skipped_steps) == 1


class _EquinoxNet(eqx.Module):
    dense: eqx.nn.Linear
    batch_norm: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        first, second = jax.random.split(key)
        self.dense = eqx.nn.Linear(4, 8, key=first)
        self.batch_norm = eqx.nn.BatchNorm(8, axis_name="batch", momentum=0.9, mode="ema")
        self.out = eqx.nn.Linear(8, 1, key=second)

    def __call__(self, x, state):
        h, state = self.batch_norm(self.dense(x), state)
        return self.out(h), state


def test_equinox_state_is_kept_on_a_skipped_step():
    X, Y, X_INF = _batch()
    model, state = eqx.nn.make_with_state(_EquinoxNet)(jax.random.key(3))
    tx = _tx()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit(donate="all-except-first")
    def train_step(x, model, state, opt_state, y):
        def loss_fn(model):
            batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
            out, new_state = batched(x, state)
            return jnp.mean((out - y) ** 2) * jls.get_loss_scale(opt_state), new_state

        grads, new_state = eqx.filter_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        kept = jls.where_applied(opt_state, new_state, state)
        return eqx.apply_updates(model, updates), kept, opt_state, new_state

    model, state, opt_state, _ = train_step(X, model, state, opt_state, Y)
    before = _copies(eqx.filter((model, state), eqx.is_array))
    model, state, opt_state, unkept = train_step(X_INF, model, state, opt_state, Y)
    assert not _finite(unkept)
    assert_bits_equal(eqx.filter((model, state), eqx.is_array), before)
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_applied_step_takes_new_and_skipped_step_old(jit):
    tx = _tx()
    params = {"w": jnp.ones(2)}
    new, old = {"s": jnp.array([1.0, -0.0]), "n": jnp.int32(7)}, {"s": jnp.zeros(2), "n": 3}
    old = {"s": old["s"], "n": jnp.int32(old["n"])}
    where_applied = jax.jit(jls.where_applied) if jit else jls.where_applied
    _, applied_state = tx.update({"w": jnp.ones(2)}, tx.init(params), params)
    _, skipped_state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, tx.init(params), params)
    assert_bits_equal(where_applied(applied_state, new, old), new)
    assert_bits_equal(where_applied(skipped_state, new, old), old)
    assert_bits_equal(where_applied(tx.init(params), new, old), new)  # before any step


def test_given_the_scale_before_output_gradient_meta_follows_the_scale_and_nothing_else():
    """fp8 meta taken through where_applied (docs/integrations.md, the exact route): flax's
    output-gradient leaves are multiplied by the new scale over the scale before, applied or
    skipped; other leaves are selected as without it."""
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(8.0, increment_period=1))
    params = {"w": jnp.ones(2)}
    layer = lambda value: {  # noqa: E731
        "output_grad_amax_history": jnp.full(3, value, jnp.float16),
        "output_grad_scale": jnp.full(1, value, jnp.float32),
        "input_scale": jnp.full(1, value, jnp.float32),
    }
    new, old = {"Dense_0": layer(3.0)}, {"Dense_0": layer(5.0)}
    grown = tx.update({"w": jnp.ones(2)}, tx.init(params), params)[1]  # 8 -> 16, applied
    backed_off = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)[1]  # -> 4
    kept = jls.where_applied(grown, new, old, scale_before=jnp.float32(8.0))["Dense_0"]
    assert_bits_equal(kept["output_grad_amax_history"], jnp.full(3, 6.0, jnp.float16))
    assert_bits_equal(kept["output_grad_scale"], jnp.full(1, 6.0, jnp.float32))
    assert_bits_equal(kept["input_scale"], jnp.full(1, 3.0, jnp.float32))
    kept = jls.where_applied(backed_off, new, old, scale_before=8.0)["Dense_0"]
    assert_bits_equal(kept["output_grad_amax_history"], jnp.full(3, 2.5, jnp.float16))
    assert_bits_equal(kept["input_scale"], jnp.full(1, 5.0, jnp.float32))
    # A product the dtype cannot hold is its largest finite value, as loss_scaled stores it.
    big = {"Dense_0": layer(40960.0)}
    kept = jls.where_applied(grown, big, old, scale_before=8.0)["Dense_0"]
    assert_bits_equal(kept["output_grad_amax_history"], jnp.full(3, 65504.0, jnp.float16))
    with pytest.raises(TypeError) as excinfo:
        jls.where_applied(grown, new, old, scale_before="8")
    assert str(excinfo.value) == (
        "where_applied(scale_before='8'): scale_before must be the loss scale before the step, "
        "a float scalar: jls.get_loss_scale(opt_state) read before tx.update"
    )


def test_mismatched_trees_are_refused_naming_the_leaf():
    tx = _tx()
    opt_state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"^where_applied: old has the structure"):
        jls.where_applied(opt_state, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"^where_applied: the leaf") as excinfo:
        jls.where_applied(opt_state, {"a": jnp.ones(2)}, {"a": jnp.ones(3)})
    assert str(excinfo.value) == (
        "where_applied: the leaf at ['a'] is ArrayImpl of dtype float32 and shape (2,) in new "
        "but ArrayImpl of dtype float32 and shape (3,) in old; the two must match"
    )
    with pytest.raises(ValueError, match=r"dtype float32 .* in new but .* dtype bfloat16"):
        jls.where_applied(opt_state, {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(TypeError, match=r"^where_applied: old leaf at \['a'\] has type str"):
        jls.where_applied(opt_state, {"a": jnp.ones(2)}, {"a": "x"})
    with pytest.raises(LookupError, match="holds no LossScaledState"):
        jls.where_applied(optax.sgd(0.1).init({"w": jnp.ones(2)}), {}, {})


def test_a_replicated_state_outside_pmap_is_refused():
    tx = _tx()
    params = {"w": jnp.ones(2)}
    # Stacked on the host: no program compiled.
    replicated = jax.tree.map(lambda leaf: jnp.asarray(np.stack([leaf, leaf])), tx.init(params))
    with pytest.raises(ValueError, match=r"has shape \(2,\); call it inside the step"):
        jls.where_applied(replicated, {"a": jnp.ones(2)}, {"a": jnp.ones(2)})


class _NnxDropoutNet(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.batch_norm = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(self.batch_norm(self.dense(x))))


def test_nnx_state_not_param_with_a_dropouts_rng_key_is_kept_on_a_skipped_step():
    """`nnx.state(model, nnx.Not(nnx.Param))` of a model with Dropout holds its RNG key
    (`key<fry>`), which was refused: every leaf had to be numeric. Typed keys are selected as
    any array: on the skipped step the statistics, the key and the counter are the old ones."""
    X, Y, X_INF = _batch()
    model = _NnxDropoutNet(nnx.Rngs(params=2, dropout=5))
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    not_params = nnx.Not(nnx.Param)
    kinds = {str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(model, not_params))}
    assert "key<fry>" in kinds

    @nnx.jit
    def train_step(model, optimizer, x, y):
        old = jax.tree.map(jnp.copy, nnx.state(model, not_params))
        scale = jls.get_loss_scale(optimizer)
        grads = nnx.grad(lambda model: jnp.mean((model(x) - y) ** 2) * scale)(model)
        optimizer.update(model, grads)
        new = nnx.state(model, not_params)
        unkept = jax.tree.map(jnp.copy, new)
        nnx.update(model, jls.where_applied(optimizer, new, old))
        return unkept

    def key_data(state):  # keys as their uint32 data, to compare bits
        is_key = lambda a: jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)  # noqa: E731
        return jax.tree.map(lambda a: jax.random.key_data(a) if is_key(a) else a, state)

    train_step(model, optimizer, X, Y)
    before = jax.tree.map(np.array, key_data(nnx.state(model, not_params)))
    unkept = key_data(train_step(model, optimizer, X_INF, Y))
    after = key_data(nnx.state(model, not_params))
    assert_bits_equal(after, before)
    assert not _finite(unkept)  # the forward pass made the statistics inf
    assert int(jls.get_loss_scale_stats(optimizer).skipped_steps) == 1
    # An applied step takes the new key and counter.
    train_step(model, optimizer, X, Y)
    moved = key_data(nnx.state(model, not_params))
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(before), strict=True)
    )
