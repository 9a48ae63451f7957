"""`loss_scaled` in flax nnx and equinox train steps, as users write them.

Each model is a tiny GPT-style character decoder: float32 master weights, float16 compute
(float32 layer norms, softmax and loss), learned positions, pre-LayerNorm blocks with a GELU
MLP. Steps are jitted with params and optimizer state donated. A `poison` input multiplies
the loss by inf on chosen steps, so that the skipped steps, and with them the scale's
trajectory, are known exactly.
"""

import functools

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_lossscale as jls

from helpers import bits

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 32, 4, 1, 16, 4
TEXT = b"the loss scale grows while gradients stay finite and backs off when they overflow. "
POISONED = [False, False, True, False, False, False]
# DynamicLossScale(2**10, increment_period=2): growth on every second finite step in a row.
EXPECTED_SCALES = [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
F16, F32 = jnp.float16, jnp.float32


def batch():
    tokens = np.frombuffer(TEXT * 2, np.uint8) % VOCAB
    starts = np.arange(BATCH) * 7
    window = np.stack([tokens[s : s + SEQ + 1] for s in starts]).astype(np.int32)
    return jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:])


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), targets).mean()


def loss_scale():
    return jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2)


def adamw_with_schedule():
    schedule = optax.linear_schedule(3e-3, 1e-3, transition_steps=10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))


# --- flax nnx -------------------------------------------------------------------------------


def causal_attention(qkv, mask):
    """Multi-head self-attention on `qkv` of shape (..., seq, 3 * DIM): the softmax in float32."""
    q, k, v = jnp.split(qkv.reshape(*qkv.shape[:-1], 3 * HEADS, DIM // HEADS), 3, axis=-2)
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / np.sqrt(DIM // HEADS).astype(qkv.dtype)
    scores = jnp.where(mask, scores.astype(F32), -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(qkv.dtype)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
    return out.reshape(*qkv.shape[:-1], DIM)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, param_dtype=F32, dtype=F16):
        kwargs = {"dtype": dtype, "param_dtype": param_dtype, "rngs": rngs}
        self.norm1 = nnx.LayerNorm(DIM, dtype=F32, param_dtype=param_dtype, rngs=rngs)
        self.qkv = nnx.Linear(DIM, 3 * DIM, **kwargs)
        self.out = nnx.Linear(DIM, DIM, **kwargs)
        self.norm2 = nnx.LayerNorm(DIM, dtype=F32, param_dtype=param_dtype, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, **kwargs)
        self.down = nnx.Linear(4 * DIM, DIM, **kwargs)

    def __call__(self, x, mask):
        x = x + self.out(causal_attention(self.qkv(self.norm1(x)), mask)).astype(x.dtype)
        return x + self.down(nnx.gelu(self.up(self.norm2(x)))).astype(x.dtype)


class NnxGPT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, param_dtype=F32, dtype=F16):
        kwargs = {"param_dtype": param_dtype, "rngs": rngs}
        self.dtype = dtype
        self.embed = nnx.Embed(VOCAB, DIM, dtype=dtype, **kwargs)
        self.positions = nnx.Param(
            (0.02 * jax.random.normal(rngs.params(), (SEQ, DIM))).astype(param_dtype)
        )
        self.blocks = nnx.List([NnxBlock(rngs, param_dtype, dtype) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, dtype=F32, **kwargs)
        self.head = nnx.Linear(DIM, VOCAB, dtype=dtype, **kwargs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.positions[...].astype(self.dtype)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x)).astype(F32)


def nnx_scaled_loss(model, scale, tokens, targets, poison):
    loss = cross_entropy(model(tokens), targets)
    return loss * scale * jnp.where(poison, jnp.inf, 1.0), loss


@nnx.jit(donate_argnums=(0, 1))
def nnx_train_step(model, optimizer, tokens, targets, poison):
    scale = jls.get_loss_scale(optimizer)
    grads, loss = nnx.grad(nnx_scaled_loss, has_aux=True)(model, scale, tokens, targets, poison)
    optimizer.update(model, grads)
    return loss


def test_nnx_float16_gpt_train_step_with_donation():
    model = NnxGPT(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jls.loss_scaled(adamw_with_schedule(), loss_scale()), wrt=nnx.Param
    )
    tokens, targets = batch()
    losses, scales = [], []
    for poison in POISONED:
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # donated by the step
        losses.append(float(nnx_train_step(model, optimizer, tokens, targets, jnp.asarray(poison))))
        scales.append(float(jls.get_loss_scale(optimizer)))
        if poison:  # skipped: every param bit for bit as before
            chex.assert_trees_all_equal(bits(nnx.state(model, nnx.Param)), bits(before))
    assert scales == EXPECTED_SCALES
    assert losses[-1] < losses[0]
    assert all(np.isfinite(losses))

    # nnx counts every call; the schedule inside the wrapper only the applied steps.
    stats = jls.get_loss_scale_stats(optimizer)
    assert int(optimizer.step[...]) == 6
    assert int(stats.skipped_steps) == 1
    counts = optax.tree_utils.tree_get_all_with_path(nnx.as_pure(optimizer.opt_state), "count")
    assert [int(count) for _, count in counts] == [5, 5]  # adam's and the schedule's
    assert int(optimizer.step[...]) - int(stats.skipped_steps) == 5


def test_nnx_lookups_work_on_the_optimizer_its_opt_state_and_its_nnx_state():
    model = NnxGPT(nnx.Rngs(1))
    # The optimizer of the test above: the same program, compiled once in a run.
    optimizer = nnx.Optimizer(
        model, jls.loss_scaled(adamw_with_schedule(), loss_scale()), wrt=nnx.Param
    )
    tokens, targets = batch()
    for poison in (False, True):
        nnx_train_step(model, optimizer, tokens, targets, jnp.asarray(poison))
    _, split_state = nnx.split((model, optimizer))
    expected = jls.LossScaleStats(
        loss_scale=jnp.float32(512.0),
        grad_norm=jnp.float32(jnp.nan),
        skipped_steps=jnp.int32(1),
        nan_skipped_steps=jnp.int32(1),  # inf times the zero gradients of some entries
        inf_skipped_steps=jnp.int32(0),
        spike_skipped_steps=jnp.int32(0),
        consecutive_skipped_steps=jnp.int32(1),
        last_step_applied=jnp.bool_(False),
    )
    holders = {
        "optimizer": optimizer,
        "opt_state": optimizer.opt_state,
        "nnx.state": nnx.state(optimizer),
        "split": split_state,
        "pure": nnx.to_pure_dict(nnx.state(optimizer)),
    }
    for name, holder in holders.items():
        scale = jls.get_loss_scale(holder)
        assert type(scale) is type(jnp.float32(1.0)), name  # a plain array, not an nnx Variable
        chex.assert_trees_all_equal(scale, jnp.float32(512.0), strict=True)
        chex.assert_trees_all_equal(jls.get_loss_scale_stats(holder), expected, strict=True)


def test_nnx_functional_split_merge_step_with_donation():
    model = NnxGPT(nnx.Rngs(2))
    optimizer = nnx.Optimizer(model, jls.loss_scaled(optax.adam(1e-3), loss_scale()), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def step(graphdef, state, tokens, targets, poison):
        model, optimizer = nnx.merge(graphdef, state)
        scale = jls.get_loss_scale(optimizer)
        grads, loss = nnx.grad(nnx_scaled_loss, has_aux=True)(model, scale, tokens, targets, poison)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    tokens, targets = batch()
    scales = []
    for poison in POISONED:
        state, _ = step(graphdef, state, tokens, targets, jnp.asarray(poison))
        scales.append(float(jls.get_loss_scale(state)))
    assert scales == EXPECTED_SCALES


def test_nnx_bfloat16_params_with_float32_gradients():
    """bfloat16 params whose gradients are accumulated in float32: adam's moments widen."""
    model = NnxGPT(nnx.Rngs(3), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(
        model, jls.loss_scaled(optax.adamw(1e-3), loss_scale()), wrt=nnx.Param
    )

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, optimizer, tokens, targets, poison):
        scale = jls.get_loss_scale(optimizer)
        grads, loss = nnx.grad(nnx_scaled_loss, has_aux=True)(model, scale, tokens, targets, poison)
        optimizer.update(model, jax.tree.map(lambda g: g.astype(F32), grads))
        return loss

    tokens, targets = batch()
    scales = []
    for poison in [True, *POISONED[1:]]:  # the very first step skipped, then one later
        before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        step(model, optimizer, tokens, targets, jnp.asarray(poison))
        scales.append(float(jls.get_loss_scale(optimizer)))
        if poison:
            chex.assert_trees_all_equal(bits(nnx.state(model, nnx.Param)), bits(before))
    assert scales == [512.0, 512.0, 256.0, 256.0, 512.0, 512.0]
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in params} == {jnp.dtype(jnp.bfloat16)}
    mu = jax.tree.leaves(nnx.as_pure(optimizer.opt_state).inner_state[0].mu)
    assert {leaf.dtype for leaf in mu} == {jnp.dtype(F32)}  # as bare optax makes them


# --- equinox -------------------------------------------------------------------------------


class EqxBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.qkv = eqx.nn.Linear(DIM, 3 * DIM, key=keys[0])
        self.out = eqx.nn.Linear(DIM, DIM, key=keys[1])
        self.up = eqx.nn.Linear(DIM, 4 * DIM, key=keys[2])
        self.down = eqx.nn.Linear(4 * DIM, DIM, key=keys[3])

    def __call__(self, x, mask):
        h = jax.vmap(self.norm1)(x.astype(F32)).astype(x.dtype)
        x = x + jax.vmap(self.out)(causal_attention(jax.vmap(self.qkv)(h), mask))
        h = jax.vmap(self.norm2)(x.astype(F32)).astype(x.dtype)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class EqxGPT(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array  # learned, float
    indices: jax.Array  # int32 0..SEQ-1: an array that is not a parameter
    blocks: list[EqxBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, LAYERS + 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (SEQ, DIM))
        self.indices = jnp.arange(SEQ, dtype=jnp.int32)
        self.blocks = [EqxBlock(k) for k in keys[2:-1]]
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=keys[-1])

    def __call__(self, tokens):  # one sequence
        x = jax.vmap(self.embed)(tokens) + self.positions[self.indices]
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        for block in self.blocks:
            x = block(x, mask)
        x = jax.vmap(self.norm)(x.astype(F32)).astype(x.dtype)
        return jax.vmap(self.head)(x)


def half(model):
    """The model with its float arrays in float16: the compute copy of the master weights."""
    return jax.tree.map(lambda x: x.astype(F16) if eqx.is_inexact_array(x) else x, model)


def eqx_scaled_loss(model, scale, tokens, targets, poison):
    loss = cross_entropy(jax.vmap(half(model))(tokens), targets)
    return loss * scale * jnp.where(poison, jnp.inf, 1.0), loss


def make_eqx_step(tx, params_of):
    @eqx.filter_jit(donate="all-except-first")
    def step(data, model, opt_state):
        tokens, targets, poison = data
        scale = jls.get_loss_scale(opt_state)
        grads, loss = eqx.filter_grad(eqx_scaled_loss, has_aux=True)(
            model, scale, tokens, targets, poison
        )
        updates, opt_state = tx.update(grads, opt_state, params_of(model))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


PARAMS_OF = {
    "filter_is_array": lambda model: eqx.filter(model, eqx.is_array),
    "model": lambda model: model,
}


@pytest.mark.parametrize("params_of", PARAMS_OF.values(), ids=PARAMS_OF.keys())
def test_equinox_float16_gpt_train_step_with_donation(params_of):
    tx = jls.loss_scaled(adamw_with_schedule(), loss_scale())
    model = EqxGPT(jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_eqx_step(tx, params_of)
    tokens, targets = batch()
    losses, scales = [], []
    for poison in POISONED:
        before = jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_array))
        model, opt_state, loss = step((tokens, targets, jnp.asarray(poison)), model, opt_state)
        losses.append(float(loss))
        scales.append(float(jls.get_loss_scale(opt_state)))
        if poison:
            chex.assert_trees_all_equal(bits(eqx.filter(model, eqx.is_array)), bits(before))
    assert scales == EXPECTED_SCALES
    assert losses[-1] < losses[0]
    assert int(jls.get_loss_scale_stats(opt_state).skipped_steps) == 1
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    assert [int(count) for _, count in counts] == [5, 5]


@pytest.mark.parametrize("params_of", PARAMS_OF.values(), ids=PARAMS_OF.keys())
def test_equinox_params_that_bare_optax_accepts_are_accepted(params_of):
    """The state initialised on the inexact arrays, `params` given as more: as bare optax takes."""
    model = EqxGPT(jax.random.key(1))
    tokens, targets = batch()
    # Jitted, as a train step runs them: op by op, their many small ops each compile alone.
    grads = eqx.filter_jit(
        eqx.filter_grad(lambda m: eqx_scaled_loss(m, 1.0, tokens, targets, False)[0])
    )(model)
    inner = optax.adamw(1e-3)
    bare_updates, _ = eqx.filter_jit(inner.update)(
        grads, inner.init(eqx.filter(model, eqx.is_inexact_array)), params_of(model)
    )
    tx = jls.loss_scaled(inner, jls.FixedLossScale(1.0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    updates, _ = eqx.filter_jit(tx.update)(grads, opt_state, params_of(model))
    chex.assert_trees_all_close(updates, bare_updates, rtol=1e-6)


# --- sgd with momentum: the skip made by selects ---------------------------------------------


def nesterov_sgd():
    return optax.sgd(0.05, momentum=0.9, nesterov=True)


def test_nnx_bfloat16_params_with_nesterov_sgd():
    """bfloat16 params and gradients under sgd with momentum, whose state is no larger than the
    gradients, so the skip is made by selects: params and momentum kept bit for bit on the
    poisoned step, which is counted as a NaN skip (inf times gradients that are zero)."""
    model = NnxGPT(nnx.Rngs(4), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    optimizer = nnx.Optimizer(model, jls.loss_scaled(nesterov_sgd(), loss_scale()), wrt=nnx.Param)
    tokens, targets = batch()
    losses, scales = [], []
    for poison in POISONED:
        kept = (nnx.state(model, nnx.Param), nnx.as_pure(optimizer.opt_state).inner_state)
        before = jax.tree.map(jnp.copy, kept)  # donated by the step
        losses.append(float(nnx_train_step(model, optimizer, tokens, targets, jnp.asarray(poison))))
        scales.append(float(jls.get_loss_scale(optimizer)))
        after = (nnx.state(model, nnx.Param), nnx.as_pure(optimizer.opt_state).inner_state)
        if poison:
            chex.assert_trees_all_equal(bits(after), bits(before))
    assert scales == EXPECTED_SCALES
    assert losses[-1] < losses[0]
    stats = jls.get_loss_scale_stats(optimizer)
    counts = (stats.skipped_steps, stats.nan_skipped_steps, stats.inf_skipped_steps)
    assert tuple(int(count) for count in counts) == (1, 1, 0)
    momentum = jax.tree.leaves(nnx.as_pure(optimizer.opt_state).inner_state)
    assert {leaf.dtype for leaf in momentum} == {jnp.dtype(jnp.bfloat16)}


def test_equinox_float16_gpt_with_nesterov_sgd():
    """The equinox GPT (float32 master weights, float16 compute) under sgd with momentum: the
    skip by selects keeps params and momentum bit for bit and counts a NaN skip."""
    tx = jls.loss_scaled(nesterov_sgd(), loss_scale())
    model = EqxGPT(jax.random.key(2))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_eqx_step(tx, PARAMS_OF["filter_is_array"])
    tokens, targets = batch()
    losses, scales = [], []
    for poison in POISONED:
        before = jax.tree.map(jnp.copy, (eqx.filter(model, eqx.is_array), opt_state.inner_state))
        model, opt_state, loss = step((tokens, targets, jnp.asarray(poison)), model, opt_state)
        losses.append(float(loss))
        scales.append(float(jls.get_loss_scale(opt_state)))
        if poison:
            after = (eqx.filter(model, eqx.is_array), opt_state.inner_state)
            chex.assert_trees_all_equal(bits(after), bits(before))
    assert scales == EXPECTED_SCALES
    assert losses[-1] < losses[0]
    stats = jls.get_loss_scale_stats(opt_state)
    counts = (stats.skipped_steps, stats.nan_skipped_steps, stats.inf_skipped_steps)
    assert tuple(int(count) for count in counts) == (1, 1, 0)
