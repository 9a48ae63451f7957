"""float16 for RL (benchmarks/rl.py at a CI size): the sampler/trainer mismatch per compute
dtype, a short GRPO run in float16 under `loss_scaled`, and what RL asks of the library:
negative and near-zero losses, `value_and_grad` with log-probs and stats as aux, and sampler
log-probs fed to the train step without a retrace."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from benchmarks import rl

# The benchmark's policy, LayerNorm and softmax in the compute dtype: at 64 sequences XLA's CPU
# programs for the sampler and the trainer round bfloat16 differently (at 16 they agree).
SIZE = rl.Size(width=64, layers=2, heads=4, digits=6, vocab=16, islands=False)
BATCH = 64


def log_probs(dtype):
    graphdef, params = rl.new_model(SIZE, 0)
    policy = jls.Policy(jnp.float32, dtype, jnp.float32)
    prompts = rl.prompts_of(rl.random_digits(jax.random.key(0), BATCH, SIZE))
    sample = jax.jit(rl.sample, static_argnums=(0, 2))
    tokens, sampled = sample(graphdef, params, policy, prompts, jax.random.key(1))
    trained = jax.jit(rl.trainer_log_probs, static_argnums=(0, 2))(graphdef, params, policy, tokens)
    where = rl.completion(SIZE)
    return tokens, sampled[:, where], trained[:, where]


def test_float16_sampler_and_trainer_agree_far_better_than_bfloat16s():
    figures = {}
    for name, dtype in [("bfloat16", jnp.bfloat16), ("float16", jnp.float16)]:
        tokens, sampled, trained = log_probs(dtype)
        assert sampled.dtype == trained.dtype == jnp.float32
        assert tokens.shape == (BATCH, SIZE.seq)
        assert ((tokens[:, SIZE.prompt :] >= 0) & (tokens[:, SIZE.prompt :] < 10)).all()
        figures[name] = rl.mismatch(trained, sampled)
    bf16, f16 = figures["bfloat16"], figures["float16"]
    # Measured here: mean |difference| 3.5e-3 against 9.3e-6, k3 1.1e-5 against 2.8e-9.
    assert bf16["mean_abs"] > 100 * f16["mean_abs"] > 0
    assert bf16["k3"] > 1000 * f16["k3"]
    assert 1e-3 < bf16["mean_abs"] < 1e-2
    assert bf16["off_10pct"] == f16["off_10pct"] == 0.0


def test_mismatch_figures_of_known_log_probs():
    trainer = jnp.log(jnp.array([0.5, 0.25, 0.2]))
    sampler = jnp.log(jnp.array([0.5, 0.2, 0.25]))
    figures = rl._floats(rl.mismatch(trainer, sampler))
    d = np.log(1.25)
    assert figures["mean_abs"] == pytest.approx(2 * d / 3, rel=1e-6)
    assert figures["max_abs"] == pytest.approx(d, rel=1e-6)
    assert figures["k3"] == pytest.approx((0.25 - d + (0.8 - 1 + d)) / 3, rel=1e-5)
    assert figures["off_10pct"] == pytest.approx(2 / 3)


def test_reward_counts_the_digits_in_place():
    tokens = jnp.array([[rl.BOS, 1, 2, 3, rl.SEP, 3, 2, 1], [rl.BOS, 1, 2, 3, rl.SEP, 3, 0, 0]])
    assert rl.reward(tokens, rl.Size(digits=3)).tolist() == pytest.approx([1.0, 1 / 3])


@pytest.fixture(scope="module")
def grpo_float16():
    argv = ["--width", "64", "--layers", "2", "--heads", "4", "--digits", "6", "--no-islands"]
    argv += ["--groups", "16", "--group-size", "8", "--grpo-steps", "30"]
    return rl.grpo_run(rl._parse(argv), "float16", 0, increment_period=4)


def test_grpo_in_float16_learns_and_its_scale_grows_on_schedule(grpo_float16):
    history, traces = grpo_float16
    # Sampler and train step traced once: the sampler's log-probs are arrays of one shape.
    assert traces == {"sampler": 1, "train": 1}
    rewards = np.array(history["reward"])
    assert rewards[-10:].mean() > rewards[:10].mean() + 0.03
    # GRPO's loss is near zero and of either sign (the advantages of a group sum to zero)...
    losses = np.array(history["loss"])
    assert (losses < 0).any()
    assert (losses > 0).any()
    assert np.abs(losses).max() < 1e-3
    # ...and the scale follows the finite steps alone: doubled every 4th step up to 2**20,
    # where float16's backward pass overflows; each skipped step halves it back to 2**19.
    log2_scales = [int(np.log2(scale)) for scale in history["loss_scale"]]
    assert log2_scales[:21] == [15 + (step + 1) // 4 for step in range(21)]
    assert max(log2_scales) == 20
    skips = np.diff([0.0, *history["skipped"]])
    skipped = np.flatnonzero(skips)  # [21, 29] with jax 0.10 here
    assert 1 <= len(skipped) <= 3
    assert skipped[0] > 20
    assert all(5 <= gap <= 8 for gap in np.diff(skipped))  # docs/rl.md: one step in 5 to 8
    for step in np.flatnonzero(skips):
        assert (log2_scales[step - 1], log2_scales[step]) == (20, 19)
    assert history["clip_fraction"] == [0.0] * 30  # the mismatch never reaches the clip
    assert max(history["mean_abs"]) < 1e-4


@pytest.mark.parametrize("jit", [False, True], ids=["no-jit", "jit"])
def test_the_scale_does_not_drift_under_a_negative_or_near_zero_loss(jit):
    params = {"w": jnp.array([0.5, -0.25, 2.0], jnp.float32)}
    tx = jls.loss_scaled(optax.adam(1e-3), jls.DynamicLossScale(2.0**10, increment_period=3))

    def step(params, opt_state, sign):
        def loss(params):  # float16, about -1e-4 or +1e-4, as an RL objective can be
            return sign * 1e-4 * jnp.sum(jnp.tanh(params["w"].astype(jnp.float16)))

        value, grads = jls.value_and_grad(loss, opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    step = jax.jit(step) if jit else step
    runs = {}
    for sign in (-1.0, 1.0):
        state, opt_state, scales, values, grads = params, tx.init(params), [], [], []
        for _ in range(7):
            state, opt_state, value, grad = step(state, opt_state, jnp.float16(sign))
            scales.append(float(jls.get_loss_scale(opt_state)))
            values.append(float(value))
            grads.append(grad["w"])
        runs[sign] = scales, values, grads
    expected = [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0, 4096.0]  # grown every 3rd
    assert runs[-1.0][0] == runs[1.0][0] == expected
    assert all(value < 0 for value in runs[-1.0][1])
    assert -2e-4 < runs[-1.0][1][0] < -1e-4
    np.testing.assert_array_equal(runs[-1.0][2][0], -runs[1.0][2][0])
    assert np.all(np.abs(runs[-1.0][2][0]) > 0)


def test_value_and_grad_with_log_probs_and_stats_as_aux_in_float16():
    graphdef, params = rl.new_model(SIZE, 0)
    policy = jls.Policy(jnp.float32, jnp.float16, jnp.float32)
    tokens = rl.prompts_of(rl.random_digits(jax.random.key(0), 4, SIZE))
    tokens = jnp.concatenate([tokens, tokens[:, 1 : 1 + SIZE.digits][:, ::-1]], axis=1)
    advantages = jnp.array([1.0, -1.0, 0.5, -0.5])

    def loss(params):
        lp = rl.trainer_log_probs(graphdef, params, policy, tokens)[:, rl.completion(SIZE)]
        objective = jnp.exp(lp - jax.lax.stop_gradient(lp)) * advantages[:, None]
        return -objective.mean(), (lp, {"mean_log_prob": lp.mean()})

    scale = jnp.float32(2.0**15)
    (value, (lp, stats)), grads = jax.jit(
        lambda params, scale: jls.value_and_grad(loss, scale, has_aux=True)(params)
    )(params, scale)

    def by_hand(params):  # what jls.value_and_grad computes for a float32 loss
        value, aux = loss(params)
        return value * scale, aux

    (ref_value, (ref_lp, ref_stats)), ref_grads = jax.jit(
        jax.value_and_grad(by_hand, has_aux=True)
    )(params)
    assert value.dtype == lp.dtype == jnp.float32
    assert lp.shape == (4, SIZE.digits)
    np.testing.assert_array_equal(lp, ref_lp)
    assert float(value) * 2.0**15 == float(ref_value)
    assert float(stats["mean_log_prob"]) == float(ref_stats["mean_log_prob"])
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_array_equal(got, want)
