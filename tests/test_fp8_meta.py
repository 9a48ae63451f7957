"""fp8 meta state under `loss_scaled`: scales and amax histories set to their new values.

A two-layer flax linen MLP whose Dense layers use `fp8_ops.Fp8DotGeneralOp` runs on the
CPU under float16-style loss scaling at 2**10. Its `_overwrite_with_gradient` collection
holds, per layer, the scales and the 1,024-long amax histories of the input, the kernel and
the output gradient; their "gradients" are their new values.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen import fp8_ops
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_lossscale as jls
from jax_lossscale._fp8_meta import OVERWRITE_WITH_GRADIENT
from jax_lossscale._loss_scaled import in_form
from jax_lossscale._platforms import Form

from helpers import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
SCALE = 2.0**10


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dot_general_cls=fp8_ops.Fp8DotGeneralOp)(x)
        return nn.Dense(1, dot_general_cls=fp8_ops.Fp8DotGeneralOp)(nn.relu(x))


MODEL = MLP()


@functools.cache
def _batch():
    """X, Y and X_INF: jax's random values, made at the first test that needs them, not at
    import."""
    x = jax.random.normal(jax.random.key(1), (32, 8))
    y = jax.random.normal(jax.random.key(2), (32, 1))
    x_inf = np.array(x)  # set on the host: no program compiled
    x_inf[0, 0] = np.inf  # one bad pixel: fp8 casts saturate, the loss stays finite
    return x, y, jnp.asarray(x_inf)


@functools.cache
def initial_variables():
    """The model's initial variables, made at the first test that needs them, not at import."""
    with pytest.warns(DeprecationWarning, match="Fp8DotGeneralOp is deprecated"):
        return jax.jit(MODEL.init)(jax.random.key(0), _batch()[0])  # one program, not op by op


KERNEL_AMAX = 0.779305636882782  # max |kernel| of the first layer
INPUT_AMAX = 3.036859989166260  # max |X|


def _loss(variables, x, y):
    return jnp.mean((MODEL.apply(variables, x) - y) ** 2)


FLAX_GRAD = jax.jit(jax.grad(_loss))  # flax's own gradient: one program, not op by op


def _tx(inner=None, fp8_meta=None, loss_scale=None):
    return jls.loss_scaled(
        inner or optax.adam(1e-2), loss_scale or jls.DynamicLossScale(SCALE), fp8_meta=fp8_meta
    )


def _layer(variables, layer="Dense_0"):
    """The layer's meta leaves, on the host."""
    return jax.tree.map(np.asarray, variables[OWG][layer]["Fp8DotGeneralOp_0"])


def _whole_tree_step(tx):
    """What a user of `jls.value_and_grad` on the whole variables tree writes."""

    @jax.jit
    def step(variables, opt_state, x, y):
        _, grads = jls.value_and_grad(_loss, opt_state)(variables, x, y)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    return step


def _train_state_step(tx, follow=True):
    """The exact route: the updates to the params alone, the collection through where_applied
    (given the scale before the step, unless not `follow`: then the output gradients' meta
    leaves keep the old scale, as before `scale_before`)."""

    @jax.jit
    def step(variables, opt_state, x, y):
        _, grads = jls.value_and_grad(_loss, opt_state)(variables, x, y)
        scale_before = jls.get_loss_scale(opt_state) if follow else None
        updates, opt_state = tx.update(grads, opt_state, variables)
        meta = jls.where_applied(opt_state, grads[OWG], variables[OWG], scale_before=scale_before)
        new = {"params": optax.apply_updates(variables["params"], updates["params"]), OWG: meta}
        return new, opt_state

    return step


TX = _tx()
WHOLE_TREE_STEP = _whole_tree_step(TX)
TRAIN_STATE_STEP = _train_state_step(TX)


def _followed(tree, factor):
    """`tree` with the output gradients' meta leaves times `factor`, as a change of the scale
    leaves them."""

    def follow(path, leaf):
        if path[-1].key in ("output_grad_amax_history", "output_grad_scale"):
            return (np.asarray(leaf) * np.float32(factor)).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(follow, tree)


def _no_inf(tree):
    return all(bool(np.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


def test_the_collection_name_is_flax_s():
    assert OVERWRITE_WITH_GRADIENT == fp8_ops.OVERWRITE_WITH_GRADIENT == "_overwrite_with_gradient"


def test_whole_tree_meta_leaves_are_set_not_optimized():
    # Before: meta leaves treated as params (fp8_meta=False) are unscaled and fed to adam.
    X, Y, _ = _batch()
    tx = _tx(fp8_meta=False)
    garbage, _ = _whole_tree_step(tx)(initial_variables(), tx.init(initial_variables()), X, Y)
    np.testing.assert_allclose(_layer(garbage)["kernel_scale"], [0.9900002], rtol=1e-6)
    np.testing.assert_allclose(_layer(garbage)["kernel_amax_history"][0], -0.0099998, rtol=1e-4)

    variables, opt_state = WHOLE_TREE_STEP(initial_variables(), TX.init(initial_variables()), X, Y)
    layer = _layer(variables)
    assert float(layer["kernel_scale"][0]) == 1.0
    assert float(layer["kernel_amax_history"][0]) == np.float32(KERNEL_AMAX)
    assert float(layer["input_amax_history"][0]) == np.float32(INPUT_AMAX)
    assert float(layer["output_grad_amax_history"][0]) == 36.0  # of the scaled gradient
    kernel = initial_variables()["params"]["Dense_0"]["kernel"]
    assert float(np.max(np.abs(kernel))) == np.float32(KERNEL_AMAX)
    np.testing.assert_array_equal(layer["kernel_amax_history"][1:], np.zeros(1023, np.float32))
    # Never given to inner: adam's moments have no entry for them.
    mu = opt_state.inner_state[0].mu
    assert jax.tree.leaves(mu[OWG]) == []
    assert jax.tree.structure(mu["params"]) == jax.tree.structure(initial_variables()["params"])


def test_train_state_route_sees_an_inf_amax_as_an_overflow():
    X, Y, X_INF = _batch()
    batches = [X, X_INF, X]
    # Before: flax's TrainState hands the optimizer the params alone and copies the collection.
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial_variables(), tx=TX)

    @jax.jit
    def flax_step(state, x, y):
        _, grads = jls.value_and_grad(_loss, state.opt_state)(state.params, x, y)
        return state.apply_gradients(grads=grads)

    for x in batches:
        state = flax_step(state, x, Y)
    assert float(jls.get_loss_scale(state.opt_state)) == SCALE  # the overflow went unseen
    assert float(_layer(state.params)["input_amax_history"][-1]) == np.inf  # poisoned
    np.testing.assert_allclose(_layer(state.params)["input_scale"], [0.0067787], rtol=1e-4)

    # After: the whole gradients to tx.update, the collection through where_applied.
    variables, opt_state = initial_variables(), TX.init(initial_variables())
    variables, opt_state = TRAIN_STATE_STEP(variables, opt_state, X, Y)
    after_first = jax.tree.map(np.asarray, variables)
    variables, opt_state = TRAIN_STATE_STEP(variables, opt_state, X_INF, Y)
    stats = jls.get_loss_scale_stats(opt_state)
    assert not bool(stats.last_step_applied)
    assert int(stats.inf_skipped_steps) == 1
    assert float(stats.loss_scale) == SCALE / 2
    # Kept bit for bit, but the output gradients' meta, which follow the back-off.
    assert_bits_equal(variables, _followed(after_first, 0.5))
    variables, opt_state = TRAIN_STATE_STEP(variables, opt_state, X, Y)
    assert bool(jls.get_loss_scale_stats(opt_state).last_step_applied)
    assert _no_inf(variables)
    history = _layer(variables)["input_amax_history"]
    assert float(history[0]) == float(history[-1]) == np.float32(INPUT_AMAX)
    np.testing.assert_allclose(_layer(variables)["input_scale"], [INPUT_AMAX / 448], rtol=1e-6)


def test_whole_tree_skip_keeps_every_bit_and_backs_off():
    X, Y, X_INF = _batch()
    variables, opt_state = WHOLE_TREE_STEP(initial_variables(), TX.init(initial_variables()), X, Y)
    before = jax.tree.map(np.asarray, variables)
    variables, opt_state = WHOLE_TREE_STEP(variables, opt_state, X_INF, Y)
    # Kept bit for bit, but the output gradients' meta, which follow the back-off.
    assert_bits_equal(variables, _followed(before, 0.5))
    assert float(_layer(variables)["output_grad_scale"][0]) == 0.5
    stats = jls.get_loss_scale_stats(opt_state)
    assert (float(stats.loss_scale), int(stats.inf_skipped_steps)) == (SCALE / 2, 1)
    assert float(stats.grad_norm) < 1.0  # the gradients themselves were finite


def test_whole_tree_equals_the_train_state_route_on_clean_steps():
    # Clipping inside inner: the meta leaves must not count in its global norm.
    X, Y, _ = _batch()
    inner = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    tx = _tx(inner)
    whole, train = _whole_tree_step(tx), _train_state_step(tx)
    a, a_state = initial_variables(), tx.init(initial_variables())
    b, b_state = initial_variables(), tx.init(initial_variables())
    for k in range(3):
        x = X * (1.0 + k)
        old = a
        a, a_state = whole(a, a_state, x, Y)
        b, b_state = train(b, b_state, x, Y)
        assert_bits_equal(a["params"], b["params"])
        chex.assert_trees_all_equal(a_state, b_state)
        # new - old added back: exact within a factor of two, else within one ulp of the larger.
        for new_a, new_b, before in zip(
            jax.tree.leaves(a[OWG]), jax.tree.leaves(b[OWG]), jax.tree.leaves(old[OWG]), strict=True
        ):
            new_a, new_b, before = map(np.asarray, (new_a, new_b, before))
            larger = np.maximum(np.abs(new_b), np.abs(before))
            assert np.all(np.abs(new_a - new_b) <= np.spacing(larger))
            close = (np.abs(new_b) <= 2 * np.abs(before)) & (np.abs(before) <= 2 * np.abs(new_b))
            np.testing.assert_array_equal(new_a[close], new_b[close])
    assert float(_layer(b)["input_amax_history"][0]) == np.float32(3 * INPUT_AMAX)

    # The norm of the last step is its params' gradients' alone, unscaled.
    @jax.jit  # one program, not op by op
    def unscaled_norm(variables, x, scale):
        grads = jls.value_and_grad(_loss, scale)(variables, x, Y)[1]
        return optax.tree.norm(grads["params"]) / scale

    np.testing.assert_allclose(
        jls.get_loss_scale_stats(b_state).grad_norm,
        unscaled_norm(old, x, jnp.float32(SCALE)),
        rtol=1e-5,
    )


def test_updates_set_new_values_within_one_rounding():
    rng = np.random.default_rng(0)
    old = (rng.lognormal(0, 3, 10_000) * rng.choice([-1, 1], 10_000)).astype(np.float32)
    new = (rng.lognormal(0, 3, 10_000) * rng.choice([-1, 1], 10_000)).astype(np.float32)
    old[:5] = [0.0, 0.1, 1.0, 0.779305636882782, 3.0]
    new[:5] = [0.7793056, 0.5, 0.0, 0.0, 1.5]
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(SCALE))
    params = {"params": {"w": jnp.ones(2)}, OWG: {"amax": jnp.asarray(old)}}
    grads = {"params": {"w": jnp.full(2, SCALE)}, OWG: {"amax": jnp.asarray(new)}}
    updates, _ = tx.update(grads, tx.init(params), params)
    got = np.asarray(optax.apply_updates(params, updates)[OWG]["amax"])
    assert np.all(np.abs(got - new) <= np.spacing(np.maximum(np.abs(old), np.abs(new))))
    same_sign = np.sign(new) == np.sign(old)
    within_two = same_sign & (np.abs(new) <= 2 * np.abs(old)) & (np.abs(old) <= 2 * np.abs(new))
    within_two |= (old == 0) | (new == 0)
    np.testing.assert_array_equal(got[within_two], new[within_two])
    np.testing.assert_array_equal(got[:5], new[:5])
    assert not np.array_equal(got, new)  # elsewhere, one rounding from it


SMALL = {"params": {"w": jnp.array([1.0, 2.0])}, OWG: {"amax": jnp.array([0.5, 0.25])}}


@pytest.mark.parametrize(
    "fp8_meta",
    [None, {"params": False, OWG: True}, lambda path, leaf: "amax" in jax.tree_util.keystr(path)],
    ids=["default", "mask", "predicate"],
)
@pytest.mark.parametrize("loss_scale", ["dynamic", "fixed"])
def test_small_tree_rules(jit_or_eager, fp8_meta, loss_scale):
    ls = jls.DynamicLossScale(4.0) if loss_scale == "dynamic" else jls.FixedLossScale(4.0)
    tx = jls.loss_scaled(optax.sgd(0.5), ls, fp8_meta=fp8_meta)
    opt_state = tx.init(SMALL)

    def step(grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, SMALL)
        return optax.apply_updates(SMALL, updates), opt_state

    grads = {"params": {"w": jnp.array([4.0, 4.0])}, OWG: {"amax": jnp.array([3.0, 0.75])}}
    new, opt_state = jit_or_eager(step, grads, opt_state)
    chex.assert_trees_all_equal(
        new, {"params": {"w": jnp.array([0.5, 1.5])}, OWG: {"amax": jnp.array([3.0, 0.75])}}
    )
    assert float(jls.get_loss_scale_stats(opt_state).grad_norm) == np.float32(np.sqrt(2.0))

    # A non-finite new meta value skips the step under every loss scale, the params kept.
    bad = {"params": {"w": jnp.array([4.0, 4.0])}, OWG: {"amax": jnp.array([jnp.inf, 0.75])}}
    kept, opt_state = jit_or_eager(step, bad, opt_state)
    assert_bits_equal(kept, SMALL)
    stats = jls.get_loss_scale_stats(opt_state)
    assert (bool(stats.last_step_applied), int(stats.inf_skipped_steps)) == (False, 1)
    assert float(stats.loss_scale) == (2.0 if loss_scale == "dynamic" else 4.0)


def test_an_equinox_mask_of_a_callable_module_is_a_mask_not_a_predicate(jit_or_eager):
    """An equinox mask (`jax.tree.map(lambda _: False, model)`, then `eqx.tree_at`) is an
    instance of the model's class, callable: it was called as a predicate `(path, leaf)`,
    and raised `TypeError: __call__() takes 2 positional arguments but 3 were given`."""
    import equinox as eqx

    class Fp8Linear(eqx.Module):
        w: jax.Array
        amax_history: jax.Array

        def __call__(self, x):
            return x @ self.w

    params = Fp8Linear(jnp.ones((2, 2)), jnp.zeros(4))
    mask = eqx.tree_at(lambda m: m.amax_history, jax.tree.map(lambda _: False, params), True)
    assert callable(mask)
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(4.0), fp8_meta=mask)
    grads = Fp8Linear(jnp.full((2, 2), 4.0), jnp.array([5.0, 0.0, 0.0, 0.0]))
    updates, opt_state = jit_or_eager(tx.update, grads, tx.init(params), params)
    new = eqx.apply_updates(params, updates)
    chex.assert_trees_all_equal(new.w, jnp.full((2, 2), 0.9))  # 1 - 0.1 * 4 / 4
    chex.assert_trees_all_equal(new.amax_history, jnp.array([5.0, 0.0, 0.0, 0.0]))  # set
    assert float(jls.get_loss_scale_stats(opt_state).grad_norm) == 2.0  # w's alone


def test_bad_fp8_meta_arguments():
    with pytest.raises(TypeError, match=r"loss_scaled\(fp8_meta=3\): fp8_meta must be None"):
        jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta=3)
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta=lambda path, leaf: jnp.array(True)
    )
    with pytest.raises(
        TypeError, match=r"^loss_scaled\.init: the fp8_meta predicate returned .* a Python"
    ):
        tx.init(SMALL)
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta={"a": True})
    with pytest.raises(ValueError, match=r"^loss_scaled\.init: the fp8_meta mask has the"):
        tx.init(SMALL)
    with pytest.raises(ValueError, match=r"^loss_scaled\.update: the fp8_meta mask has the"):
        tx.update(SMALL, tx.init({"a": jnp.ones(1)}), SMALL)
    with pytest.raises(TypeError, match=r"value_and_grad\(fp8_meta=3\): fp8_meta must be None"):
        jls.value_and_grad(lambda p: p, jnp.float32(1.0), fp8_meta=3)
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
    with pytest.raises(ValueError, match=r"hold fp8 meta leaves.*pass params"):
        tx.update(SMALL, tx.init(SMALL))
    with pytest.raises(ValueError, match="params must have their structure"):
        tx.update(SMALL, tx.init(SMALL), SMALL["params"])


def test_optax_multisteps_inside_keeps_every_microbatch_amax():
    X, Y, X_INF = _batch()
    tx = _tx(optax.MultiSteps(optax.adam(1e-2), 2))
    step = _train_state_step(tx)  # exact, so that the entries are the amaxes bit for bit
    variables, opt_state = initial_variables(), tx.init(initial_variables())
    for x in [X, 2 * X, X_INF, 0.5 * X, 4 * X]:  # the third microbatch overflows: dropped
        variables, opt_state = step(variables, opt_state, x, Y)
    history = np.asarray(_layer(variables)["input_amax_history"])
    # flax rolls the history by one and writes the newest entry first: one per microbatch.
    a = np.float32(INPUT_AMAX)
    np.testing.assert_array_equal(history[[0, -3, -2, -1]], [4 * a, a, 2 * a, a / 2])
    np.testing.assert_array_equal(history[1:-3], np.zeros(1020, np.float32))
    assert int(opt_state.inner_state.gradient_step) == 2  # both windows complete
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1


def _single_device_reference(x, y):
    """One step on the whole batch on one device."""
    return WHOLE_TREE_STEP(initial_variables(), TX.init(initial_variables()), x, y)


def _data_parallel_step(tx, exact=False):
    """One device's step over the "data" axis: its loss is its share of the whole batch's
    mean, the params' gradients are summed, and the meta leaves are left to `loss_scaled`,
    which combines them by max; or, `exact`, combined by max here and taken through
    `where_applied` (docs/integrations.md's exact route under an axis)."""
    batch_size = _batch()[0].shape[0]

    def step(variables, opt_state, x, y):
        def loss(variables):
            return jnp.sum((MODEL.apply(variables, x) - y) ** 2) / batch_size

        _, grads = jls.value_and_grad(loss, opt_state)(variables)
        grads = {"params": jax.lax.psum(grads["params"], "data"), OWG: grads[OWG]}
        scale_before = jls.get_loss_scale(opt_state)
        updates, opt_state = tx.update(grads, opt_state, variables)
        if not exact:
            return optax.apply_updates(variables, updates), opt_state
        new_meta = jax.lax.pmax(grads[OWG], "data")
        meta = jls.where_applied(opt_state, new_meta, variables[OWG], scale_before=scale_before)
        params = optax.apply_updates(variables["params"], updates["params"])
        return {"params": params, OWG: meta}, opt_state

    return step


def test_pmap_replicas_agree_with_one_device_on_the_whole_batch():
    X, Y, X_INF = _batch()
    n = jax.device_count()
    tx = jls.loss_scaled(optax.adam(1e-2), jls.DynamicLossScale(SCALE), "data")
    step = jax.pmap(_data_parallel_step(tx), axis_name="data", in_axes=(None, None, 0, 0))

    # Reshaped and reversed on the host: no program compiled.
    x, y, x_inf = np.asarray(X), np.asarray(Y), np.asarray(X_INF)
    shards = jnp.asarray(x.reshape(n, -1, 8)), jnp.asarray(y.reshape(n, -1, 1))
    replicas, opt_states = step(initial_variables(), tx.init(initial_variables()), *shards)
    replicas = jax.tree.map(np.asarray, replicas)  # compared on the host
    first = jax.tree.map(lambda leaf: leaf[0], replicas)
    for k in range(1, n):
        assert_bits_equal(jax.tree.map(lambda leaf, k=k: leaf[k], replicas), first)
    expected, _ = _single_device_reference(X, Y)
    chex.assert_trees_all_close(first, expected, rtol=1e-6, atol=0)
    assert float(_layer(first)["input_amax_history"][0]) == np.float32(INPUT_AMAX)
    assert float(_layer(first)["output_grad_amax_history"][0]) == 36.0
    # The exact route, the collection combined by max first: the whole batch's amaxes too.
    exact_step = jax.pmap(
        _data_parallel_step(tx, exact=True), axis_name="data", in_axes=(None, None, 0, 0)
    )
    exact = exact_step(initial_variables(), tx.init(initial_variables()), *shards)[0]
    exact = jax.tree.map(lambda leaf: np.asarray(leaf)[n - 1], exact)
    chex.assert_trees_all_close(exact, first, rtol=1e-6, atol=0)
    assert float(_layer(exact)["input_amax_history"][0]) == np.float32(INPUT_AMAX)

    # One device's inf pixel skips the step on every device, the meta kept everywhere.
    bad = jnp.asarray(x_inf.reshape(n, -1, 8)[::-1]), jnp.asarray(y.reshape(n, -1, 1)[::-1])
    kept, opt_states = step(initial_variables(), tx.init(initial_variables()), *bad)
    kept = jax.tree.map(np.asarray, kept)
    for k in range(n):
        kept_k = jax.tree.map(lambda leaf, k=k: leaf[k], kept)
        assert_bits_equal(kept_k, _followed(initial_variables(), 0.5))
    np.testing.assert_array_equal(jls.get_loss_scale_stats(opt_states).loss_scale, [SCALE / 2] * n)


def test_spmd_jit_with_a_sharded_batch_equals_one_device():
    X, Y, _ = _batch()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    # Put from the host: a copy to the devices, no resharding program compiled.
    x = jax.device_put(np.asarray(X), NamedSharding(mesh, PartitionSpec("data")))
    y = jax.device_put(np.asarray(Y), NamedSharding(mesh, PartitionSpec("data")))
    got, _ = WHOLE_TREE_STEP(initial_variables(), TX.init(initial_variables()), x, y)
    expected, _ = _single_device_reference(X, Y)
    chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=0)
    assert float(_layer(got)["input_amax_history"][0]) == np.float32(INPUT_AMAX)


E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)


def _saturation(grads):
    """Per layer, this step's output-gradient amax over the most its fp8 scale holds."""
    ratios = []
    for name in ("Dense_0", "Dense_1"):
        layer = _layer(grads, name)
        limit = layer["output_grad_scale"][0] * np.float32(E5M2_MAX)  # in float32, as in jax
        ratios.append(float(layer["output_grad_amax_history"][0] / limit))
    return ratios


def test_output_gradient_meta_follows_the_loss_scale_when_it_grows():
    X, Y, _ = _batch()
    tx = _tx(loss_scale=jls.DynamicLossScale(SCALE, increment_period=1))
    followed, followed_state = _whole_tree_step(tx)(
        initial_variables(), tx.init(initial_variables()), X, Y
    )
    plain, plain_state = _train_state_step(tx, follow=False)(
        initial_variables(), tx.init(initial_variables()), X, Y
    )
    exact, _ = _train_state_step(tx)(initial_variables(), tx.init(initial_variables()), X, Y)
    assert float(jls.get_loss_scale(followed_state)) == 2 * SCALE
    layer = _layer(followed)
    assert float(_layer(plain)["output_grad_amax_history"][0]) == 36.0
    assert float(layer["output_grad_amax_history"][0]) == 72.0  # the amax at the new scale
    assert_bits_equal(_layer(exact), layer)  # the exact route, given the scale before
    assert float(layer["output_grad_scale"][0]) == 2.0
    assert float(layer["input_amax_history"][0]) == np.float32(INPUT_AMAX)  # forward: as it was
    # The step after the growth: its gradients are twice as large. Where the history did not
    # follow, their largest entries are clipped to about half their value (the first layer sees
    # the second's clipped gradients); where it did, only by
    # what the step itself changed (flax's scales keep no margin).
    gradients = jax.jit(lambda state, v: jls.value_and_grad(_loss, state)(v, X, Y)[1])
    grads, plain_grads = gradients(followed_state, followed), gradients(plain_state, plain)
    np.testing.assert_allclose(_saturation(grads), [1.0417507, 0.9851083], rtol=1e-5)
    np.testing.assert_allclose(_saturation(plain_grads), [1.458451, 1.9702165], rtol=1e-5)


def _meta_leaves(tree):
    """The meta leaves of `tree`, by name, and whether each holds output-gradient amaxes."""
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree[OWG])[0]:
        named[jax.tree_util.keystr(path)] = (leaf, path[-1].key.startswith("output_grad"))
    return named


@functools.cache
def _meta_grad(loss_dtype):
    """The gradients from `jls.value_and_grad` of the loss in `loss_dtype`, at a given scale."""
    X, Y, _ = _batch()

    def loss(variables):
        return _loss(variables, X, Y).astype(loss_dtype)

    return jax.jit(lambda variables, scale: jls.value_and_grad(loss, scale)(variables)[1])


@functools.cache
def _flax_variables():
    """The variables after two steps that set the meta state as flax sets it."""
    X, Y, _ = _batch()
    variables = initial_variables()
    for x in (X, 2 * X):
        new = FLAX_GRAD(variables, x, Y)[OWG]
        variables = {"params": variables["params"], OWG: new}
    return variables


@functools.cache
def _carried_grad(loss_dtype):
    """flax's own gradient of the loss in `loss_dtype` times `carried`: one program per dtype."""
    X, Y, _ = _batch()

    def carried_loss(variables, carried):
        return _loss(variables, X, Y).astype(loss_dtype).astype(jnp.float32) * carried

    return jax.jit(jax.grad(carried_loss))


@pytest.mark.parametrize("loss_dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("scale", [2.0**16, 2.0**17, 1000.0])
def test_value_and_grad_gives_the_meta_values_as_flax_computes_them(loss_dtype, scale):
    # Before: a float16 or bfloat16 loss multiplied them by the rest of the scale (at 2**16,
    # kernel_scale 2.0 where flax computes 1.0; at 1000, 1.953).
    X, Y, _ = _batch()
    variables = _flax_variables()
    got = _meta_leaves(_meta_grad(loss_dtype)(variables, jnp.float32(scale)))
    # The forward side, whatever the scale and the loss dtype: flax's own gradient, bit for bit.
    flax_meta = _meta_leaves(FLAX_GRAD(variables, X, Y))
    # The output gradients' side: flax's value for the part of the scale the backward pass
    # carries, with those leaves divided by the rest and multiplied back (a float16 loss
    # carries at most 2**15: at 2**16 and 2**17 the layers run with them halved, quartered;
    # at 1000 a half loss carries 512, and they run divided by 1.953125, which makes them hold
    # amaxes at the scale, as loss_scaled's rescaling at a change of the scale takes them).
    is_half = loss_dtype != jnp.float32
    carried = min(scale, 2.0**15) if loss_dtype == jnp.float16 else scale
    carried = 2.0 ** np.floor(np.log2(carried)) if is_half else carried
    lift = np.float32(scale / carried) if is_half else np.float32(1.0)
    lowered = jax.tree_util.tree_map_with_path(  # on the host, in float32 as the library does
        lambda path, leaf: (
            np.asarray(leaf) / lift if path[-1].key.startswith("output_grad") else leaf
        ),
        variables,
    )
    flax_carried = _meta_leaves(_carried_grad(loss_dtype)(lowered, np.float32(carried)))
    assert got.keys() == flax_meta.keys()
    assert len(got) == 12
    for name, (leaf, output_side) in got.items():
        expected = flax_carried[name][0] * lift if output_side else flax_meta[name][0]
        assert_bits_equal(leaf, expected)
    kernel_scale = got["['Dense_0']['Fp8DotGeneralOp_0']['kernel_scale']"][0]
    assert float(kernel_scale[0]) == np.float32(KERNEL_AMAX / 448)


@functools.cache
def _three_routes(loss_dtype, loss_scale):
    """One jitted step of each route at a learning rate of 0: the TrainState route, the
    whole-tree route and the exact route, from the same variables."""
    tx = jls.loss_scaled(optax.sgd(0.0), loss_scale)
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial_variables(), tx=tx)
    _, Y, _ = _batch()

    def loss(variables, x):
        return _loss(variables, x, Y).astype(loss_dtype)

    @jax.jit
    def steps(state, whole, whole_state, exact, exact_state, x):
        _, grads = jls.value_and_grad(loss, state.opt_state)(state.params, x)
        state = state.apply_gradients(grads=grads)
        _, grads = jls.value_and_grad(loss, whole_state)(whole, x)
        updates, whole_state = tx.update(grads, whole_state, whole)
        whole = optax.apply_updates(whole, updates)
        _, grads = jls.value_and_grad(loss, exact_state)(exact, x)
        scale_before = jls.get_loss_scale(exact_state)
        updates, exact_state = tx.update(grads, exact_state, exact)
        meta = jls.where_applied(exact_state, grads[OWG], exact[OWG], scale_before=scale_before)
        exact = {"params": exact["params"], OWG: meta}
        return state, whole, whole_state, exact, exact_state

    return tx, state, steps


@pytest.mark.parametrize(
    ("loss_dtype", "loss_scale"),
    [
        (jnp.float16, jls.DynamicLossScale(2.0**16)),
        (jnp.bfloat16, jls.FixedLossScale(1000.0)),
    ],
    ids=["float16-2**16", "bfloat16-fixed-1000"],
)
def test_every_route_keeps_flax_s_meta_values_over_steps(loss_dtype, loss_scale):
    # Before: a float16 loss at 2**16 doubled the amax histories every step (3.3e12 by step 40)
    # and every step was skipped from step 71.
    X, Y, _ = _batch()
    tx, state, steps = _three_routes(loss_dtype, loss_scale)
    whole = exact = initial_variables()
    whole_state = exact_state = tx.init(initial_variables())
    flax_variables = initial_variables()
    for k in range(4):
        x = X * (1.0 + k)
        state, whole, whole_state, exact, exact_state = steps(
            state, whole, whole_state, exact, exact_state, x
        )
        flax_variables = {
            "params": flax_variables["params"],
            OWG: FLAX_GRAD(flax_variables, x, Y)[OWG],
        }
    expected = _meta_leaves(flax_variables)
    for route in (state.params, whole, exact):
        for name, (leaf, output_side) in _meta_leaves(route).items():
            if not output_side:  # the forward side: bit for bit, on every route
                assert_bits_equal(leaf, expected[name][0])
    assert_bits_equal(state.params[OWG], exact[OWG])  # the output gradients' side too
    for name, (leaf, _) in _meta_leaves(whole).items():  # float32 leaves: within one rounding
        np.testing.assert_allclose(leaf, _meta_leaves(exact)[name][0], rtol=2**-23, atol=0)
    assert int(jls.get_loss_scale_stats(whole_state).skipped_steps) == 0
    layer = _layer(exact)
    np.testing.assert_array_equal(
        np.asarray(layer["input_amax_history"])[[0, -3, -2, -1]],
        np.float32(INPUT_AMAX) * np.array([4, 1, 2, 3], np.float32),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_whole_tree_updates_set_half_precision_meta_exactly(dtype):
    # Before: bfloat16 kernel_scale 1.0 -> 0.00174 was stored as 0; float16 as 0.00195.
    old = np.array([1.0, 1.0, 0.0, 3.0, 0.0078125, 4.0, 2.0**-10], np.float32)
    new = np.array([0.00174, 0.0067787, 0.5, 0.0, 300.0, 0.0041, 5.0], np.float32)
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(SCALE))
    params = {"params": {"w": jnp.ones(2)}, OWG: {"scale": jnp.asarray(old, dtype)}}
    grads = {"params": {"w": jnp.full(2, SCALE)}, OWG: {"scale": jnp.asarray(new, dtype)}}
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    got = np.asarray(optax.apply_updates(params, updates)[OWG]["scale"])  # checked on the host
    if dtype == jnp.float32:  # one float32 addition cannot give 0.00174 from 1.0
        assert float(got[0]) != np.float32(0.00174)
        assert np.all(np.abs(got - new) <= np.spacing(np.maximum(old, new)))
    else:
        assert_bits_equal(got, grads[OWG]["scale"])
    # Any two within 2**13 (float16) or 2**16 (bfloat16) of each other: exact.
    rng = np.random.default_rng(0)
    reach, spread = (1, 12.9) if dtype == jnp.float16 else (40, 15.9)
    old = (2.0 ** rng.uniform(-reach, reach, 4000) * rng.choice([-1, 1], 4000)).astype(dtype)
    new = (old.astype(np.float32) * 2.0 ** rng.uniform(-spread, spread, 4000)).astype(dtype)
    if dtype != jnp.float32:
        params = {"params": {"w": jnp.ones(2)}, OWG: {"scale": jnp.asarray(old)}}
        grads = {"params": {"w": jnp.full(2, SCALE)}, OWG: {"scale": jnp.asarray(new)}}
        updates, _ = tx.update(grads, tx.init(params), params)
        assert_bits_equal(optax.apply_updates(params, updates)[OWG]["scale"], grads[OWG]["scale"])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_output_gradient_meta_saturates_instead_of_overflowing_on_a_growth(dtype):
    # Before: 40960 * 2 was stored as inf in a float16 history; every step after was skipped.
    name = "output_grad_amax_history"
    tx = jls.loss_scaled(optax.sgd(1.0), jls.DynamicLossScale(4.0, increment_period=1))
    big = float(jnp.finfo(dtype).max) / 1.6
    params = {"params": {"w": jnp.ones(2)}, OWG: {name: jnp.asarray(np.zeros(3, dtype))}}
    grads = {"params": {"w": jnp.ones(2)}, OWG: {name: jnp.array([big, 1.0, 0.0], dtype)}}
    step = jax.jit(tx.update)
    updates, opt_state = step(grads, tx.init(params), params)
    assert float(jls.get_loss_scale(opt_state)) == 8.0  # it grew
    params = optax.apply_updates(params, updates)
    largest = jnp.finfo(dtype).max
    assert_bits_equal(params[OWG][name], np.array([largest, 2.0, 0.0], dtype))
    updates, opt_state = step(grads, opt_state, params)
    assert bool(jls.get_loss_scale_stats(opt_state).last_step_applied)
    assert float(jls.get_loss_scale(opt_state)) == 16.0


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(x)
        return nn.Dense(1, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)(nn.relu(x))


@functools.cache
def _tiny_variables():
    """TinyMLP's initial variables, the same for every run: one program, not one per run."""
    x0 = jax.random.normal(jax.random.key(3), (16, 4))
    return jax.jit(TinyMLP().init)(jax.random.key(0), x0)


@functools.cache
def _long_run(steps, loss_dtype, initial_scale, form=Form.LOWERED):
    """The whole-tree and exact routes side by side over `steps` steps of one `lax.scan`: the
    scale grows every 20 clean steps and backs off at an inf pixel every 25th step. `form`:
    the platform form of `loss_scaled`'s step (`_loss_scaled.in_form`)."""

    def _tiny_loss(variables, x, y):
        return jnp.mean((TinyMLP().apply(variables, x) - y) ** 2).astype(loss_dtype)

    scale = jls.DynamicLossScale(initial_scale, increment_period=20)
    tx = in_form(form, optax.adam(3e-3), scale)
    variables = _tiny_variables()
    w_true = jnp.array([[1.0], [-2.0], [0.5], [1.5]])

    def body(carry, k):
        whole, whole_state, exact, exact_state = carry
        x = jax.random.normal(jax.random.fold_in(jax.random.key(4), k), (16, 4))
        y = x @ w_true
        x = jnp.where(k % 25 == 24, x.at[0, 0].set(jnp.inf), x)
        scale = jls.get_loss_scale(whole_state)
        loss_w, grads = jls.value_and_grad(_tiny_loss, whole_state)(whole, x, y)
        newest = grads[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"][0]
        updates, whole_state = tx.update(grads, whole_state, whole)
        whole = optax.apply_updates(whole, updates)
        loss_e, grads = jls.value_and_grad(_tiny_loss, exact_state)(exact, x, y)
        scale_before = jls.get_loss_scale(exact_state)
        updates, exact_state = tx.update(grads, exact_state, exact)
        meta = jls.where_applied(exact_state, grads[OWG], exact[OWG], scale_before=scale_before)
        exact = {"params": optax.apply_updates(exact["params"], updates["params"]), OWG: meta}
        applied = [
            jls.get_loss_scale_stats(s).last_step_applied for s in (whole_state, exact_state)
        ]
        return (whole, whole_state, exact, exact_state), (*applied, loss_w, loss_e, newest / scale)

    carry = (variables, tx.init(variables), variables, tx.init(variables))
    return jax.jit(lambda carry: jax.lax.scan(body, carry, jnp.arange(steps)))(carry)


@pytest.mark.parametrize(
    ("loss_dtype", "initial_scale"),
    [(jnp.float32, 2.0**10), (jnp.float16, 2.0**15)],
    ids=["float32", "float16-loss-across-2**15"],
)
def test_output_gradient_meta_follows_every_growth_and_back_off_over_a_long_run(
    loss_dtype, initial_scale
):
    # Before: each back-off-then-growth cycle doubled the stored history's overestimate
    # (3.8e13 by step 1,000), clean gradients became 0.0, the loss fell behind the exact route.
    # A float16 loss carries at most 2**15 through the backward pass, the rest of the scale
    # multiplying the gradients; the histories follow the whole scale all the same.
    (whole, whole_state, exact, exact_state), outputs = _long_run(400, loss_dtype, initial_scale)
    applied_whole, applied_exact, loss_whole, loss_exact, unscaled = map(np.asarray, outputs)
    assert int(applied_whole.sum()) == int(applied_exact.sum()) == 384  # 16 inf pixels
    assert not np.any(applied_exact & ~applied_whole)
    scale = float(jls.get_loss_scale(whole_state))
    assert scale == float(jls.get_loss_scale(exact_state))
    # The stored history is every applied step's amax at the current scale: the
    # newest first, then, from the end backwards, the ones before it (flax's roll).
    amaxes = unscaled[applied_whole] * np.float32(scale)
    history = np.asarray(
        whole[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    )
    expected = np.zeros(1024, np.float32)
    expected[0] = amaxes[-1]
    expected[-len(amaxes) + 1 :] = amaxes[:-1]
    # (Within a few float32 roundings: the whole-tree route adds new - old.)
    np.testing.assert_allclose(history, expected, rtol=1e-6, atol=0)
    # The exact route (given the scale before each step) follows it as well. Before
    # `scale_before`: half of it after every growth, and e5m2 clipped the next step's gradients.
    for name in ("output_grad_amax_history", "output_grad_scale"):
        np.testing.assert_allclose(
            exact[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"][name],
            whole[OWG]["Dense_0"]["Fp8DirectDotGeneralOp_0"][name],
            rtol=1e-6,
            atol=0,
        )
    late_whole, late_exact = loss_whole[-50:].mean(), loss_exact[-50:].mean()
    assert abs(late_whole - late_exact) <= 0.1 * late_exact, (late_whole, late_exact)


@pytest.mark.parametrize("loss_dtype", [jnp.float16, jnp.bfloat16])
def test_with_a_half_loss_and_scales_no_power_of_two_the_history_holds_amaxes_at_the_scale(
    loss_dtype,
):
    """A half loss's backward pass carries a power of two; the rest of a scale of 1000 *
    1.5**k is not one. With the learning rate 0 and one batch the true amax is the same at
    every step, so the newest entry, measured at the scale, equals the one before it as
    loss_scaled rescaled it at the growth. Before: the layers measured at the part carried,
    and the two differed by 1.5 or 0.75 (e5m2 then clipped the largest gradients by 4/3)."""
    tx = jls.loss_scaled(
        optax.sgd(0.0), jls.DynamicLossScale(1000.0, increment_period=1, multiplier=1.5)
    )
    x = jax.random.normal(jax.random.key(7), (16, 4))
    y = x @ jnp.array([[1.0], [-2.0], [0.5], [1.5]])

    def loss(variables):
        return jnp.mean((TinyMLP().apply(variables, x) - y) ** 2).astype(loss_dtype)

    @jax.jit
    def step(variables, opt_state):
        _, grads = jls.value_and_grad(loss, opt_state)(variables)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    variables, opt_state = _tiny_variables(), tx.init(_tiny_variables())
    scales, ratios = [], []
    for _ in range(6):
        scales.append(float(jls.get_loss_scale(opt_state)))
        variables, opt_state = step(variables, opt_state)
        for layer in ("Dense_0", "Dense_1"):
            history = variables[OWG][layer]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
            ratios.append(float(history[-1] / history[0]))  # the one before, over the newest
    assert scales == [1000.0 * 1.5**k for k in range(6)]
    np.testing.assert_allclose(ratios[4:], 1.0, rtol=1e-5)  # from the third step on


def test_the_gpu_form_decides_and_keeps_fp8_meta_as_the_cpu_form_with_a_float16_loss():
    """fp8 layers with a float16 loss over 400 steps in the GPU form, whose step reads the
    state's scalars out of one vector: the CPU form's decisions and scale exactly, and its
    output gradients' amax history to float32 rounding (the programs are fused differently)."""
    cpu = _long_run(400, jnp.float16, 2.0**15)  # lowered for this CPU: the CPU form
    gpu = _long_run(400, jnp.float16, 2.0**15, Form.GPU)
    (cpu_whole, cpu_state, _, _), cpu_outputs = cpu
    (gpu_whole, gpu_state, _, gpu_exact_state), gpu_outputs = gpu
    for got, expected in zip(gpu_outputs[:2], cpu_outputs[:2], strict=True):
        np.testing.assert_array_equal(got, expected)
    assert int(np.asarray(gpu_outputs[0]).sum()) == 384  # 16 inf pixels skipped
    assert float(jls.get_loss_scale(gpu_state)) == float(jls.get_loss_scale(cpu_state))
    assert float(jls.get_loss_scale(gpu_exact_state)) == float(jls.get_loss_scale(cpu_state))
    assert_bits_equal(gpu_state.stats[1:], cpu_state.stats[1:])
    path = (OWG, "Dense_0", "Fp8DirectDotGeneralOp_0", "output_grad_amax_history")
    gpu_history, cpu_history = gpu_whole, cpu_whole
    for key in path:
        gpu_history, cpu_history = gpu_history[key], cpu_history[key]
    np.testing.assert_allclose(gpu_history, cpu_history, rtol=1e-6, atol=0)


def _shard_map_step(check_vma):
    """A data-parallel step under `shard_map` over every device, as docs/distributed.md has it."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = jls.loss_scaled(optax.adam(1e-2), jls.DynamicLossScale(SCALE), "data")
    replicated, batch = PartitionSpec(), PartitionSpec("data")
    mapped = jax.shard_map(
        _data_parallel_step(tx),
        mesh=mesh,
        in_specs=(replicated, replicated, batch, batch),
        out_specs=(replicated, replicated),
        check_vma=check_vma,
    )
    return jax.jit(mapped), tx


def test_shard_map_needs_check_vma_false_for_flax_fp8_layers():
    # flax's fp8 custom VJP gives the meta leaves' cotangents without the device axis in their
    # type; shard_map's default check refuses them (docs/distributed.md says so).
    X, Y, X_INF = _batch()
    step, tx = _shard_map_step(check_vma=True)
    with pytest.raises(Exception, match="manual axis types do not match"):
        step(initial_variables(), tx.init(initial_variables()), X, Y)
    step, tx = _shard_map_step(check_vma=False)
    got, _ = step(initial_variables(), tx.init(initial_variables()), X, Y)
    expected, _ = _single_device_reference(X, Y)
    chex.assert_trees_all_close(got, expected, rtol=1e-6, atol=0)
    assert float(_layer(got)["input_amax_history"][0]) == np.float32(INPUT_AMAX)
    # One device's inf pixel: the step is skipped on every device.
    # Reversed on the host: no program compiled.
    x_inf, y = jnp.asarray(np.asarray(X_INF)[::-1]), jnp.asarray(np.asarray(Y)[::-1])
    kept, opt_state = step(initial_variables(), tx.init(initial_variables()), x_inf, y)
    assert_bits_equal(kept, _followed(initial_variables(), 0.5))
    assert float(jls.get_loss_scale(opt_state)) == SCALE / 2


def test_optax_multisteps_outside_sets_the_meta_to_the_mean_of_the_microbatches():
    # The trap docs/integrations.md names: MultiSteps averages the meta leaves' updates as it
    # averages gradients, so each meta leaf ends the window at the mean of the microbatches'
    # values (an amax of 4.555 = mean(3.037, 6.074), below the largest); inside, each is kept.
    X, Y, _ = _batch()
    tx = optax.MultiSteps(_tx(), 2)
    step = _whole_tree_step(tx)
    variables, opt_state = initial_variables(), tx.init(initial_variables())
    for x in [X, 2 * X]:
        variables, opt_state = step(variables, opt_state, x, Y)
    got = float(_layer(variables)["input_amax_history"][0])
    a = np.float32(INPUT_AMAX)
    np.testing.assert_allclose(got, (a + 2 * a) / 2, rtol=1e-6)
    np.testing.assert_allclose(got, 4.555290, rtol=1e-6)
