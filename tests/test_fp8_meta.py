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
X = jax.random.normal(jax.random.key(1), (32, 8))
Y = jax.random.normal(jax.random.key(2), (32, 1))
X_INF = X.at[0, 0].set(jnp.inf)  # one bad pixel: fp8 casts saturate, the loss stays finite


@functools.cache
def initial_variables():
    """The model's initial variables, made at the first test that needs them, not at import."""
    with pytest.warns(DeprecationWarning, match="Fp8DotGeneralOp is deprecated"):
        return MODEL.init(jax.random.key(0), X)


KERNEL_AMAX = 0.779305636882782  # max |kernel| of the first layer
INPUT_AMAX = 3.036859989166260  # max |X|


def _loss(variables, x, y):
    return jnp.mean((MODEL.apply(variables, x) - y) ** 2)


def _tx(inner=None, fp8_meta=None, loss_scale=None):
    return jls.loss_scaled(
        inner or optax.adam(1e-2), loss_scale or jls.DynamicLossScale(SCALE), fp8_meta=fp8_meta
    )


def _layer(variables, layer="Dense_0"):
    return variables[OWG][layer]["Fp8DotGeneralOp_0"]


def _whole_tree_step(tx):
    """What a user of `jls.value_and_grad` on the whole variables tree writes."""

    @jax.jit
    def step(variables, opt_state, x, y):
        _, grads = jls.value_and_grad(_loss, opt_state)(variables, x, y)
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    return step


def _train_state_step(tx):
    """The exact route: the updates to the params alone, the collection through where_applied."""

    @jax.jit
    def step(variables, opt_state, x, y):
        _, grads = jls.value_and_grad(_loss, opt_state)(variables, x, y)
        updates, opt_state = tx.update(grads, opt_state, variables)
        new = {
            "params": optax.apply_updates(variables["params"], updates["params"]),
            OWG: jls.where_applied(opt_state, grads[OWG], variables[OWG]),
        }
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
            return (leaf * np.float32(factor)).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(follow, tree)


def _no_inf(tree):
    return all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(tree))


def test_the_collection_name_is_flax_s():
    assert OVERWRITE_WITH_GRADIENT == fp8_ops.OVERWRITE_WITH_GRADIENT == "_overwrite_with_gradient"


def test_whole_tree_meta_leaves_are_set_not_optimized():
    # Before: meta leaves treated as params (fp8_meta=False) are unscaled and fed to adam.
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
    assert float(
        jnp.max(jnp.abs(initial_variables()["params"]["Dense_0"]["kernel"]))
    ) == np.float32(KERNEL_AMAX)
    np.testing.assert_array_equal(layer["kernel_amax_history"][1:], np.zeros(1023, np.float32))
    # Never given to inner: adam's moments have no entry for them.
    mu = opt_state.inner_state[0].mu
    assert jax.tree.leaves(mu[OWG]) == []
    assert jax.tree.structure(mu["params"]) == jax.tree.structure(initial_variables()["params"])


def test_train_state_route_sees_an_inf_amax_as_an_overflow():
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
    assert_bits_equal(variables, after_first)
    variables, opt_state = TRAIN_STATE_STEP(variables, opt_state, X, Y)
    assert bool(jls.get_loss_scale_stats(opt_state).last_step_applied)
    assert _no_inf(variables)
    history = _layer(variables)["input_amax_history"]
    assert float(history[0]) == float(history[-1]) == np.float32(INPUT_AMAX)
    np.testing.assert_allclose(_layer(variables)["input_scale"], [INPUT_AMAX / 448], rtol=1e-6)


def test_whole_tree_skip_keeps_every_bit_and_backs_off():
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
    _, grads = jls.value_and_grad(_loss, jnp.float32(SCALE))(old, x, Y)
    np.testing.assert_allclose(
        jls.get_loss_scale_stats(b_state).grad_norm,
        optax.tree.norm(grads["params"]) / SCALE,
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


def test_bad_fp8_meta_arguments():
    with pytest.raises(TypeError, match=r"loss_scaled\(fp8_meta=3\): fp8_meta must be None"):
        jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta=3)
    tx = jls.loss_scaled(
        optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta=lambda path, leaf: jnp.array(True)
    )
    with pytest.raises(TypeError, match=r"fp8_meta predicate returned .* must return a Python"):
        tx.init(SMALL)
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale(), fp8_meta={"a": True})
    with pytest.raises(ValueError, match="fp8_meta mask has the structure"):
        tx.init(SMALL)
    tx = jls.loss_scaled(optax.sgd(0.1), jls.DynamicLossScale())
    with pytest.raises(ValueError, match=r"hold fp8 meta leaves.*pass params"):
        tx.update(SMALL, tx.init(SMALL))
    with pytest.raises(ValueError, match="params must have their structure"):
        tx.update(SMALL, tx.init(SMALL), SMALL["params"])


def test_optax_multisteps_inside_keeps_every_microbatch_amax():
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


def test_pmap_replicas_agree_with_one_device_on_the_whole_batch():
    n = jax.device_count()
    tx = jls.loss_scaled(optax.adam(1e-2), jls.DynamicLossScale(SCALE), "data")

    @functools.partial(jax.pmap, axis_name="data", in_axes=(None, None, 0, 0))
    def step(variables, opt_state, x, y):
        # Each device's loss is its share of the whole batch's mean: the params' gradients
        # are summed; the meta leaves are left to loss_scaled, which combines them by max.
        def loss(v):
            return jnp.sum((MODEL.apply(v, x) - y) ** 2) / X.shape[0]

        _, grads = jls.value_and_grad(loss, opt_state)(variables)
        grads = {"params": jax.lax.psum(grads["params"], "data"), OWG: grads[OWG]}
        updates, opt_state = tx.update(grads, opt_state, variables)
        return optax.apply_updates(variables, updates), opt_state

    shards = X.reshape(n, -1, 8), Y.reshape(n, -1, 1)
    replicas, opt_states = step(initial_variables(), tx.init(initial_variables()), *shards)
    first = jax.tree.map(lambda leaf: leaf[0], replicas)
    for k in range(1, n):
        assert_bits_equal(jax.tree.map(lambda leaf, k=k: leaf[k], replicas), first)
    expected, _ = _single_device_reference(X, Y)
    chex.assert_trees_all_close(first, expected, rtol=1e-6, atol=0)
    assert float(_layer(first)["input_amax_history"][0]) == np.float32(INPUT_AMAX)
    assert float(_layer(first)["output_grad_amax_history"][0]) == 36.0

    # One device's inf pixel skips the step on every device, the meta kept everywhere.
    bad = X_INF.reshape(n, -1, 8)[::-1], shards[1][::-1]
    kept, opt_states = step(initial_variables(), tx.init(initial_variables()), *bad)
    for k in range(n):
        kept_k = jax.tree.map(lambda leaf, k=k: leaf[k], kept)
        assert_bits_equal(kept_k, _followed(initial_variables(), 0.5))
    np.testing.assert_array_equal(jls.get_loss_scale_stats(opt_states).loss_scale, [SCALE / 2] * n)


def test_spmd_jit_with_a_sharded_batch_equals_one_device():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(X, NamedSharding(mesh, PartitionSpec("data")))
    y = jax.device_put(Y, NamedSharding(mesh, PartitionSpec("data")))
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
        limit = layer["output_grad_scale"][0] * E5M2_MAX
        ratios.append(float(layer["output_grad_amax_history"][0] / limit))
    return ratios


def test_output_gradient_meta_follows_the_loss_scale_when_it_grows():
    tx = _tx(loss_scale=jls.DynamicLossScale(SCALE, increment_period=1))
    followed, followed_state = _whole_tree_step(tx)(
        initial_variables(), tx.init(initial_variables()), X, Y
    )
    plain, plain_state = _train_state_step(tx)(
        initial_variables(), tx.init(initial_variables()), X, Y
    )
    assert float(jls.get_loss_scale(followed_state)) == 2 * SCALE
    layer = _layer(followed)
    assert float(_layer(plain)["output_grad_amax_history"][0]) == 36.0
    assert float(layer["output_grad_amax_history"][0]) == 72.0  # the amax at the new scale
    assert float(layer["output_grad_scale"][0]) == 2.0
    assert float(layer["input_amax_history"][0]) == np.float32(INPUT_AMAX)  # forward: as it was
    # The step after the growth: its gradients are twice as large. Where the history did not
    # follow, their largest entries are clipped to about half their value (the first layer sees
    # the second's clipped gradients); where it did, only by
    # what the step itself changed (flax's scales keep no margin).
    _, grads = jls.value_and_grad(_loss, followed_state)(followed, X, Y)
    _, plain_grads = jls.value_and_grad(_loss, plain_state)(plain, X, Y)
    np.testing.assert_allclose(_saturation(grads), [1.0417507, 0.9851083], rtol=1e-5)
    np.testing.assert_allclose(_saturation(plain_grads), [1.458451, 1.9702165], rtol=1e-5)
