"""float16 for RL: the sampler/trainer log-prob mismatch per compute dtype, and GRPO runs.

A small decoder-only policy (flax nnx, float32 params) computes under a `jls.Policy` in
float32, bfloat16 or float16: matrix products in the compute dtype, the log-softmax of the
logits in float32, and LayerNorm and the attention softmax in float32 ("float32 islands") or,
with `--no-islands`, in the compute dtype. It samples with a KV cache, one token a
step under `lax.scan` (the sampler), and scores whole sequences in one forward pass (the
trainer), as RL fine-tuning does. The task is verifiable: reverse a string of digits.

The mismatch: for sequences the sampler draws in each dtype, the trainer's log-prob of each
completion token against the sampler's: the mean and largest absolute difference, the k3
estimate of KL(sampler || trainer), and the fraction of tokens whose ratio
exp(trainer - sampler) is off 1 by more than 10%; beside them the same figures for the
trainer in that dtype against the trainer in float32 on the same tokens (the dtype's own
rounding). Measured at initialisation and after supervised training (peaked logits), under
XLA's default flags and, in a subprocess, with `--xla_allow_excess_precision=false`.

The GRPO runs: groups of samples per prompt, the reward the fraction of digits in place,
group-normalised advantages, the PPO-clipped ratio between trainer and sampler log-probs,
adam; float16 inside `jls.loss_scaled(..., jls.DynamicLossScale(...))` with the gradients from
`jls.value_and_grad`, against bfloat16 and float32 with plain adam, over several seeds.
Recorded per step: the reward, the mismatch, the clip fraction, the loss scale and the
skipped steps. The runs of docs/rl.md, each under 5 minutes on 2 CPU cores:

    python -m benchmarks rl --grpo-steps 0 --batches 16,64 \
        --json benchmarks/results/rl-mismatch-cpu.json
    python -m benchmarks rl --no-mismatch --no-islands --grpo-steps 120 --seeds 0,1 \
        --json benchmarks/results/rl-grpo-cpu.json
    python -m benchmarks rl --no-mismatch --no-islands --grpo-steps 100 --grpo-init-steps 150 \
        --updates-per-batch 2 --learning-rate 1e-3 --increment-periods 400 --seeds 0,1 \
        --json benchmarks/results/rl-grpo-peaked-cpu.json
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from benchmarks.measure import command, default_path, machine, write_results

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DIGITS, BOS, SEP = 10, 10, 11  # tokens 0-9 are digits; the vocabulary may hold unused ones
NO_EXCESS_PRECISION = "--xla_allow_excess_precision=false"


@dataclasses.dataclass(frozen=True)
class Size:
    width: int = 64
    layers: int = 2
    heads: int = 4
    digits: int = 6
    vocab: int = 16
    islands: bool = True  # LayerNorm and the attention softmax in float32

    @property
    def prompt(self) -> int:
        return self.digits + 2  # BOS, the digits, SEP

    @property
    def seq(self) -> int:
        return self.prompt + self.digits


# --- the policy -------------------------------------------------------------------------------


def _param(key: jax.Array, shape: tuple[int, ...], scale: float) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(key, shape, jnp.float32))


class Block(nnx.Module):
    def __init__(self, size: Size, rngs: nnx.Rngs):
        w = size.width
        self.heads, self.islands = size.heads, size.islands
        self.ln1 = nnx.List([nnx.Param(jnp.ones(w)), nnx.Param(jnp.zeros(w))])
        self.qkv = _param(rngs.params(), (w, 3 * w), w**-0.5)
        self.out = _param(rngs.params(), (w, w), (2 * size.layers * w) ** -0.5)
        self.ln2 = nnx.List([nnx.Param(jnp.ones(w)), nnx.Param(jnp.zeros(w))])
        self.up = _param(rngs.params(), (w, 4 * w), w**-0.5)
        self.down = _param(rngs.params(), (4 * w, w), (8 * size.layers * w) ** -0.5)


class Decoder(nnx.Module):
    """A GPT-style decoder whose matrix products run in its params' dtype."""

    def __init__(self, size: Size, rngs: nnx.Rngs):
        self.size = size
        self.embed = _param(rngs.params(), (size.vocab, size.width), 1.0)
        self.pos = _param(rngs.params(), (size.seq, size.width), 0.1)
        self.blocks = nnx.List([Block(size, rngs) for _ in range(size.layers)])
        self.ln = nnx.List([nnx.Param(jnp.ones(size.width)), nnx.Param(jnp.zeros(size.width))])
        self.head = _param(rngs.params(), (size.width, size.vocab), size.width**-0.5)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)


def _island(fn: Any, islands: bool) -> Any:
    """`fn` in float32 (`jls.full_precision`) where the model keeps float32 islands."""
    return jls.full_precision(fn) if islands else fn


def _normed(x: jax.Array, ln: nnx.List, islands: bool) -> jax.Array:
    return _island(layer_norm, islands)(x, ln[0][...], ln[1][...]).astype(x.dtype)


def _embed(model: Decoder, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    return model.embed[...][tokens] + model.pos[...][positions]


def _block_qkv(block: Block, x: jax.Array):
    h = _normed(x, block.ln1, block.islands)
    q, k, v = jnp.split(h @ block.qkv[...], 3, axis=-1)
    shape = (*x.shape[:-1], block.heads, x.shape[-1] // block.heads)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def _block_rest(block: Block, x, q, k, v, mask):
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    probs = _island(softmax, block.islands)(scores, mask).astype(q.dtype)
    attended = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(x.shape)
    x = x + attended @ block.out[...]
    h = _normed(x, block.ln2, block.islands)
    return x + jax.nn.gelu(h @ block.up[...]) @ block.down[...]


def _log_probs_of(model: Decoder, x: jax.Array) -> jax.Array:
    """Log-softmax of the logits, in float32 (the logits themselves in the compute dtype)."""
    logits = _normed(x, model.ln, model.size.islands) @ model.head[...]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def in_compute(graphdef: Any, params: Any, policy: jls.Policy) -> Decoder:
    """The policy's model: float32 params cast to the compute dtype."""
    return nnx.merge(graphdef, policy.cast_to_compute(params))


def trainer_log_probs(graphdef: Any, params: Any, policy: jls.Policy, tokens: jax.Array):
    """The trainer: one forward pass over whole sequences; log-probs [b, seq - 1] of
    tokens[:, 1:], float32."""
    model = in_compute(graphdef, params, policy)
    seq = tokens.shape[1]
    x = _embed(model, tokens, jnp.arange(seq))
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    for block in model.blocks:
        q, k, v = _block_qkv(block, x)
        x = _block_rest(block, x, q, k, v, mask)
    log_probs = _log_probs_of(model, x)[:, :-1]
    return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]


def sample(
    graphdef: Any, params: Any, policy: jls.Policy, prompts: jax.Array, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The sampler: one token a step under `lax.scan` with a KV cache in the compute dtype.
    Prompt tokens are fed as given, the rest drawn at temperature 1 from the digits; returns
    the sequences [b, seq] and the log-probs [b, seq - 1] of tokens[:, 1:] (float32)."""
    model = in_compute(graphdef, params, policy)
    size = model.size
    batch, (seq, prompt) = prompts.shape[0], (size.seq, size.prompt)
    heads, dim = size.heads, size.width // size.heads
    cache = [(jnp.zeros((batch, seq, heads, dim), policy.compute_dtype),) * 2 for _ in model.blocks]
    padded = jnp.zeros((batch, seq), jnp.int32).at[:, :prompt].set(prompts)

    def step(carry, position):
        token, cache, key = carry
        x = _embed(model, token[:, None], position[None])
        mask = (jnp.arange(seq) <= position)[None, :]
        new_cache = []
        for block, (k_cache, v_cache) in zip(model.blocks, cache, strict=True):
            q, k, v = _block_qkv(block, x)
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k, position, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v, position, axis=1)
            x = _block_rest(block, x, q, k_cache, v_cache, mask)
            new_cache.append((k_cache, v_cache))
        log_probs = _log_probs_of(model, x)[:, 0]
        key, subkey = jax.random.split(key)
        drawn = jax.random.categorical(subkey, log_probs[:, :DIGITS]).astype(jnp.int32)
        nxt = jnp.where(position + 1 < prompt, padded[:, position + 1], drawn)
        chosen = jnp.take_along_axis(log_probs, nxt[:, None], axis=-1)[:, 0]
        return (nxt, new_cache, key), (nxt, chosen)

    _, (tokens, log_probs) = jax.lax.scan(
        step, (padded[:, 0], cache, key), jnp.arange(seq - 1, dtype=jnp.int32)
    )
    tokens = jnp.concatenate([padded[:, :1], tokens.T], axis=1)
    return tokens, log_probs.T


# --- the task ---------------------------------------------------------------------------------


def prompts_of(digits: jax.Array) -> jax.Array:
    batch = digits.shape[0]
    bos = jnp.full((batch, 1), BOS, jnp.int32)
    return jnp.concatenate([bos, digits, jnp.full((batch, 1), SEP, jnp.int32)], axis=1)


def random_digits(key: jax.Array, batch: int, size: Size) -> jax.Array:
    return jax.random.randint(key, (batch, size.digits), 0, DIGITS, jnp.int32)


def reward(tokens: jax.Array, size: Size) -> jax.Array:
    """The fraction of the answer's digits in place: the prompt's digits reversed."""
    digits = tokens[:, 1 : 1 + size.digits]
    answer = tokens[:, size.prompt :]
    return (answer == digits[:, ::-1]).mean(-1)


def completion(size: Size) -> slice:
    """Where the answer's tokens are among the log-probs of tokens[:, 1:]."""
    return slice(size.prompt - 1, size.seq - 1)


def mismatch(trainer: jax.Array, sampler: jax.Array) -> dict[str, jax.Array]:
    """Figures of trainer - sampler log-probs of the same tokens, k3 = E[r - 1 - log r]
    with r = exp(trainer - sampler) an estimate of KL(sampler || trainer)."""
    diff = (trainer - sampler).astype(jnp.float32)
    ratio = jnp.exp(diff)
    return {
        "mean_abs": jnp.abs(diff).mean(),
        "k3": (ratio - 1 - diff).mean(),
        "max_abs": jnp.abs(diff).max(),
        "off_10pct": (jnp.abs(ratio - 1) > 0.1).mean(),
    }


def new_model(size: Size, seed: int) -> tuple[Any, Any]:
    graphdef, params = nnx.split(Decoder(size, nnx.Rngs(seed)))
    return graphdef, params


def supervised(graphdef: Any, params: Any, size: Size, steps: int, batch: int, seed: int):
    """`steps` of adam on the cross-entropy of the right answers, in float32: a peaked policy."""
    policy = jls.Policy(jnp.float32, jnp.float32, jnp.float32)
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, key):
        digits = random_digits(key, batch, size)
        tokens = jnp.concatenate([prompts_of(digits), digits[:, ::-1]], axis=1)

        def loss(params):
            lp = trainer_log_probs(graphdef, params, policy, tokens)[:, completion(size)]
            return -lp.mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = tx.init(params)
    key = jax.random.key(seed)
    value = jnp.nan
    for _ in range(steps):
        key, subkey = jax.random.split(key)
        params, opt_state, value = step(params, opt_state, subkey)
    return params, float(value)


# --- the mismatch -----------------------------------------------------------------------------


def measure_mismatch(graphdef: Any, params: Any, size: Size, batch: int, seed: int) -> dict:
    """Per compute dtype: the sampler/trainer mismatch on `batch` sampled sequences, and the
    trainer's distance from the float32 trainer on the same tokens."""
    key = jax.random.key(seed)
    prompts = prompts_of(random_digits(key, batch, size))
    float32 = jls.Policy(jnp.float32, jnp.float32, jnp.float32)
    rows = {}
    for name, dtype in DTYPES.items():
        policy = jls.Policy(jnp.float32, dtype, jnp.float32)
        tokens, sampled = jax.jit(sample, static_argnums=(0, 2))(
            graphdef, params, policy, prompts, jax.random.key(seed + 1)
        )
        trained = jax.jit(trainer_log_probs, static_argnums=(0, 2))(
            graphdef, params, policy, tokens
        )
        reference = jax.jit(trainer_log_probs, static_argnums=(0, 2))(
            graphdef, params, float32, tokens
        )
        where = completion(size)
        rows[name] = {
            "sampler_vs_trainer": _floats(mismatch(trained[:, where], sampled[:, where])),
            "trainer_vs_float32": _floats(mismatch(trained[:, where], reference[:, where])),
            "mean_log_prob": float(sampled[:, where].mean()),
            "reward": float(reward(tokens, size).mean()),
        }
    return rows


def _floats(tree: Any) -> Any:
    return jax.tree.map(float, tree)


def mismatch_case(args: argparse.Namespace) -> dict:
    """The mismatch at init and after training, per batch size, with and without float32
    islands (the same params: float32 training is the same either way), in this process."""
    size = dataclasses.replace(_size(args), islands=True)
    graphdef, params = new_model(size, args.seed)
    trained, loss = supervised(graphdef, params, size, args.train_steps, 64, args.seed)
    out: dict[str, Any] = {"supervised_loss": loss}
    for islands in (True, False):
        graphdef, _ = new_model(dataclasses.replace(size, islands=islands), args.seed)
        for stage, stage_params in (("init", params), ("trained", trained)):
            out[f"{stage}, {'float32 islands' if islands else 'all in the compute dtype'}"] = {
                str(batch): measure_mismatch(graphdef, stage_params, size, batch, args.seed)
                for batch in args.batches
            }
    return out


# --- GRPO -------------------------------------------------------------------------------------


def grpo_run(
    args: argparse.Namespace, dtype_name: str, seed: int, increment_period: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """One GRPO run: per step, the reward, the mismatch, the clip fraction, the loss and (in
    float16) the loss scale and the steps skipped so far; and the traces of each program."""
    size = _size(args)
    graphdef, params = new_model(size, seed)
    if args.grpo_init_steps:
        params, _ = supervised(graphdef, params, size, args.grpo_init_steps, 64, seed)
    policy = jls.Policy(jnp.float32, DTYPES[dtype_name], jnp.float32)
    scaled = dtype_name == "float16"
    tx = optax.adam(args.learning_rate)
    if scaled:
        tx = jls.loss_scaled(tx, jls.DynamicLossScale(increment_period=increment_period))
    groups, per_group, clip = args.groups, args.group_size, args.clip

    traces = {"sampler": 0, "train": 0}

    @jax.jit
    def sampler(params, prompts, key):
        traces["sampler"] += 1
        return sample(graphdef, params, policy, prompts, key)

    @jax.jit
    def train(params, opt_state, tokens, sampled, advantages):
        traces["train"] += 1

        def loss_fn(params):
            lp = trainer_log_probs(graphdef, params, policy, tokens)[:, completion(size)]
            old = sampled[:, completion(size)]
            ratio = jnp.exp(lp - old)
            adv = advantages[:, None]
            objective = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
            clipped = (jnp.abs(ratio - 1) > clip).mean()
            return -objective.mean(), (lp, clipped)

        if scaled:
            (value, (lp, clipped)), grads = jls.value_and_grad(loss_fn, opt_state, has_aux=True)(
                params
            )
        else:
            (value, (lp, clipped)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        stats = mismatch(lp, sampled[:, completion(size)])
        stats["clip_fraction"] = clipped
        stats["loss"] = value
        if scaled:
            scale_stats = jls.get_loss_scale_stats(opt_state)
            stats["loss_scale"] = scale_stats.loss_scale
            stats["skipped"] = scale_stats.skipped_steps
        return optax.apply_updates(params, updates), opt_state, stats

    opt_state = tx.init(params)
    key = jax.random.key(seed + 1000)
    history: dict[str, list[float]] = {}
    for _ in range(args.grpo_steps):
        key, k_digits, k_sample = jax.random.split(key, 3)
        digits = jnp.repeat(random_digits(k_digits, groups, size), per_group, axis=0)
        tokens, sampled = sampler(params, prompts_of(digits), k_sample)
        rewards = reward(tokens, size)
        grouped = rewards.reshape(groups, per_group)
        advantages = (grouped - grouped.mean(1, keepdims=True)) / (
            grouped.std(1, keepdims=True) + 1e-4
        )
        for update in range(args.updates_per_batch):
            params, opt_state, stats = train(
                params, opt_state, tokens, sampled, advantages.reshape(-1)
            )
            if update == 0:  # the mismatch of the params that sampled: numerics alone
                first = {name: stats[name] for name in ("mean_abs", "k3", "max_abs", "off_10pct")}
        stats.update(first, reward=rewards.mean())
        for name, value in stats.items():
            history.setdefault(name, []).append(float(value))
    return history, traces


def grpo_case(args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {}
    for period in args.increment_periods:
        for name in DTYPES:
            if name != "float16" and period != args.increment_periods[0]:
                continue
            label = f"{name}, increment_period={period}" if name == "float16" else name
            runs = {}
            for seed in args.seeds:
                start = time.perf_counter()
                history, traces = grpo_run(args, name, seed, period)
                runs[str(seed)] = {**history, "traces": traces}
                last = slice(-max(1, args.grpo_steps // 10), None)
                print(
                    f"{label} seed {seed}: reward {np.mean(history['reward'][:10]):.3f} -> "
                    f"{np.mean(history['reward'][last]):.3f}, mismatch "
                    f"{np.mean(history['mean_abs']):.2e}, clip "
                    f"{np.mean(history['clip_fraction']):.3f}"
                    + (
                        f", scale {history['loss_scale'][-1]:g}, skipped {history['skipped'][-1]:g}"
                        if "loss_scale" in history
                        else ""
                    )
                    + f" ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
            out[label] = {"runs": runs, "summary": _summary(runs, args.grpo_steps)}
    return out


def _summary(runs: dict[str, dict[str, list[float]]], steps: int) -> dict:
    last = slice(-max(1, steps // 10), None)
    summary: dict[str, Any] = {
        "final_reward": float(np.mean([np.mean(h["reward"][last]) for h in runs.values()])),
        "final_reward_per_seed": [float(np.mean(h["reward"][last])) for h in runs.values()],
        "mean_abs_mismatch": float(np.mean([np.mean(h["mean_abs"]) for h in runs.values()])),
        "k3": float(np.mean([np.mean(h["k3"]) for h in runs.values()])),
        "clip_fraction": float(np.mean([np.mean(h["clip_fraction"]) for h in runs.values()])),
    }
    if all("loss_scale" in h for h in runs.values()):
        summary["final_loss_scale"] = [h["loss_scale"][-1] for h in runs.values()]
        summary["skipped_steps"] = [h["skipped"][-1] for h in runs.values()]
    return summary


# --- the runner -------------------------------------------------------------------------------


def _size(args: argparse.Namespace) -> Size:
    return Size(args.width, args.layers, args.heads, args.digits, args.vocab, not args.no_islands)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    if args.mismatch_only:  # the subprocess under other XLA flags
        print(json.dumps(mismatch_case(args)))
        return {}
    results: dict[str, Any] = {
        "machine": machine(),
        "command": command(None if argv is None else ["rl", *argv]),
        "size": dataclasses.asdict(_size(args)),
    }
    if not args.no_mismatch:
        results["mismatch"] = {"default": mismatch_case(args)}
        if not args.no_subprocess:
            results["mismatch"][NO_EXCESS_PRECISION] = _in_subprocess(argv)
        print(mismatch_table(results["mismatch"]), flush=True)
    if args.grpo_steps:
        results["grpo"] = grpo_case(args)
    write_results(results, args.json or default_path("rl-"))
    return results


def _in_subprocess(argv: Sequence[str] | None) -> dict:
    given = list(sys.argv[1:] if argv is None else argv)
    given = given[1:] if given[:1] == ["rl"] else given
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {NO_EXCESS_PRECISION}")
    output = subprocess.run(
        [sys.executable, "-m", "benchmarks.rl", *given, "--mismatch-only"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def mismatch_table(cases: dict) -> str:
    lines = []
    for flags, case in cases.items():
        for stage, by_batch in case.items():
            if stage == "supervised_loss":
                continue
            for batch, rows in by_batch.items():
                lines.append(f"\n## mismatch, {stage}, batch {batch}, XLA flags: {flags}")
                lines.append(
                    "dtype | sampler vs trainer: mean |d|, k3, max |d|, off>10% "
                    "| trainer vs float32: mean |d|, k3"
                )
                for name, row in rows.items():
                    s, f = row["sampler_vs_trainer"], row["trainer_vs_float32"]
                    lines.append(
                        f"{name} | {s['mean_abs']:.2e}, {s['k3']:.2e}, {s['max_abs']:.2e}, "
                        f"{s['off_10pct']:.4f} | {f['mean_abs']:.2e}, {f['k3']:.2e}"
                    )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks rl", description=__doc__)
    parser.add_argument("--platform", default=None, help="cpu, gpu or tpu; default: JAX's")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--digits", type=int, default=6, help="digits to reverse")
    parser.add_argument("--vocab", type=int, default=16, help="tokens in the softmax, >= 12")
    parser.add_argument(
        "--no-islands", action="store_true", help="LayerNorm and softmax in the compute dtype"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=_ints, default="64", help="sampled sequences")
    parser.add_argument("--train-steps", type=int, default=60, help="supervised, for peaking")
    parser.add_argument("--grpo-steps", type=int, default=120, help="0 for no GRPO runs")
    parser.add_argument("--grpo-init-steps", type=int, default=0, help="supervised first")
    parser.add_argument("--seeds", type=_ints, default="0,1")
    parser.add_argument("--groups", type=int, default=16, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--updates-per-batch", type=int, default=1, help="off-policy steps")
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument(
        "--increment-periods",
        type=_ints,
        default="2000,50",
        help="DynamicLossScale increment periods of the float16 runs",
    )
    parser.add_argument("--no-mismatch", action="store_true", help="the GRPO runs alone")
    parser.add_argument("--no-subprocess", action="store_true", help="default XLA flags only")
    parser.add_argument("--mismatch-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="where to write JSON")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
