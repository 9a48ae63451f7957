"""A real model's train step: a GPT-style character decoder in flax nnx, trained in float16.

The model: learned token and position embeddings, pre-LayerNorm blocks of causal
self-attention (separate query, key, value and output projections) and a GELU MLP, a final
LayerNorm and an output projection. Parameters are float32 master weights; the projections
and the attention compute in float16; layer norms, the softmax and the loss in float32.
The text is the Python standard library's own source, found on every machine.

`SIZES` holds the two shapes measured: about 0.85M parameters in 70 leaves (4 layers of
width 128), and about 0.9M in 294 leaves (18 layers of width 64).
"""

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls

F16, F32 = jnp.float16, jnp.float32


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    width: int
    heads: int
    seq: int = 128
    batch: int = 16


SIZES = {"70 leaves": Size(layers=4, width=128, heads=4), "294 leaves": Size(18, 64, 4)}


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Multi-head causal self-attention; the scores' softmax is taken in float32."""
    batch, seq, width = q.shape
    q, k, v = (x.reshape(batch, seq, heads, width // heads) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads).astype(q.dtype)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores.astype(F32), -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(q.dtype), v)
    return out.reshape(batch, seq, width)


class Block(nnx.Module):
    def __init__(self, size: Size, rngs: nnx.Rngs):
        width = size.width
        half = {"dtype": F16, "param_dtype": F32, "rngs": rngs}
        self.heads = size.heads
        self.norm1 = nnx.LayerNorm(width, dtype=F32, rngs=rngs)
        self.query = nnx.Linear(width, width, **half)
        self.key = nnx.Linear(width, width, **half)
        self.value = nnx.Linear(width, width, **half)
        self.out = nnx.Linear(width, width, **half)
        self.norm2 = nnx.LayerNorm(width, dtype=F32, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, **half)
        self.down = nnx.Linear(4 * width, width, **half)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm1(x).astype(F16)
        attended = causal_attention(self.query(h), self.key(h), self.value(h), self.heads)
        x = x + self.out(attended).astype(F32)
        h = self.norm2(x).astype(F16)
        return x + self.down(nnx.gelu(self.up(h))).astype(F32)


class GPT(nnx.Module):
    def __init__(self, size: Size, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, size.width, dtype=F16, param_dtype=F32, rngs=rngs)
        self.positions = nnx.Param(0.02 * jax.random.normal(rngs.params(), (size.seq, size.width)))
        self.blocks = nnx.List([Block(size, rngs) for _ in range(size.layers)])
        self.norm = nnx.LayerNorm(size.width, dtype=F32, rngs=rngs)
        self.head = nnx.Linear(size.width, vocab, dtype=F16, param_dtype=F32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens).astype(F32) + self.positions[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).astype(F16)).astype(F32)  # logits in float32


def stdlib_text(max_bytes: int = 4_000_000) -> tuple[np.ndarray, int]:
    """The standard library's Python sources as token ids, one per distinct byte."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = bytearray()
    for path in paths:
        with open(path, "rb") as file:
            data += file.read()
        if len(data) >= max_bytes:
            break
    raw = np.frombuffer(bytes(data[:max_bytes]), np.uint8)
    alphabet, tokens = np.unique(raw, return_inverse=True)
    return tokens.astype(np.int32), len(alphabet)


def batches(tokens: np.ndarray, size: Size, seed: int = 0):
    """Endless (inputs, targets) batches of windows taken at random."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - size.seq - 1, size.batch)
        windows = np.stack([tokens[s : s + size.seq + 1] for s in starts])
        yield jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])


def contenders() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """The optimizers compared: bare adamw and adamw through `loss_scaled`, with spike
    skipping on (a bound and a window) and off."""

    def adamw():
        return optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10_000), weight_decay=0.01)

    def skipping_spikes():
        return jls.loss_scaled(
            adamw(), jls.DynamicLossScale(), skip_grad_norm_above=100.0, skip_spike_sigmas=6.0
        )

    return {
        "bare": adamw,
        "DynamicLossScale": lambda: jls.loss_scaled(adamw(), jls.DynamicLossScale()),
        "DynamicLossScale, spike skipping": skipping_spikes,
        "FixedLossScale": lambda: jls.loss_scaled(adamw(), jls.FixedLossScale(2.0**10)),
    }


def train_state(size: Size, vocab: int, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """`(graphdef, state)` of the model and its `nnx.Optimizer`, split for `jax.jit`."""
    model = GPT(size, vocab, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return nnx.split((model, optimizer))


def train_step_of(graphdef: Any, scaled: bool) -> Callable:
    """The train step `(state, inputs, targets) -> (state, loss)`, in nnx's functional form.

    A loss-scaled step passes its loss to the optimizer as `value=`, which spike skipping
    tests against its window.
    """

    def train_step(state, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)
        scale = jls.get_loss_scale(optimizer) if scaled else 1.0

        def loss_fn(model):
            loss = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()
            return loss * scale, loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads, **({"value": loss} if scaled else {}))
        return nnx.state((model, optimizer)), loss

    return train_step


def parameter_count(state: Any) -> tuple[int, int]:
    """`(parameters, leaves)` of the model in a split `(model, optimizer)` state."""
    leaves = jax.tree.leaves(state[0])
    return sum(leaf.size for leaf in leaves), len(leaves)
