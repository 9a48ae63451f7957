"""Ways to write a skipping, loss-scaled optimizer step, timed side by side.

`python -m benchmarks.formulations` times, for adam on 8M float32 params in 64 leaves,
the bare step and several formulations of "unscale, check, update or skip", each jitted
with params and state donated and timed block by block as `python -m benchmarks` does.
`loss_scaled` uses the fastest formulation that keeps the skip exact; the others are
kept here as the evidence, and two invalid ones (a skip without a check, a check
without a skip) price the parts a valid step cannot do without.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jax_lossscale as jls
from benchmarks.measure import Runner, block_medians, params_and_grads

SCALE = 2.0**15
OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-3, momentum=0.9, nesterov=True),
}


def _finite_by_sums(tree):
    """The check `loss_scaled` makes: a sum of `x * (x + (x - x))` per leaf, NaN exactly when
    the leaf holds a NaN or an infinity (and otherwise its squared norm), fused into one pass."""
    sums = [jnp.sum(x * (x + (x - x))) for x in jax.tree.leaves(tree)]
    return ~jnp.isnan(jnp.stack(sums)).any()


def _finite_by_booleans(tree):
    """`isfinite(x).all()` per leaf: XLA on CPU writes the booleans out, then reduces them."""
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]).all()


def _skip_updates(inner_update):
    shapes, _ = jax.eval_shape(inner_update)
    return jax.tree.map(lambda shape: jnp.full_like(shape, -0.0), shapes)


def formulations(inner):
    """name -> (step(params, state, scaled_grads), init(params), whether grads are scaled)."""

    def select_everything(params, state, grads):
        # Branch-free, what jmp and flax users write: run the update, select new or old.
        inner_state, scale = state
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = _finite_by_sums(grads)
        updates, new_state = inner.update(grads, inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, -0.0), updates)
        new_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_state, inner_state)
        return optax.apply_updates(params, updates), (new_state, scale)

    def select_updates_and_state(params, state, grads):
        # Branch-free inside the optax API: the updates and the state selected, returned.
        inner_state, scale = state
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = _finite_by_sums(grads)
        updates, new_state = inner.update(grads, inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, -0.0), updates)
        new_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_state, inner_state)
        return optax.apply_updates(params, updates), (new_state, scale)

    def select_with_booleans(params, state, grads):
        # jmp's pattern: isfinite(x).all() per leaf, the new params and state selected.
        inner_state, scale = state
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = _finite_by_booleans(grads)
        updates, new_state = inner.update(grads, inner_state, params)
        new_params = optax.apply_updates(params, updates)
        select = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)  # noqa: E731
        return select(new_params, params), (select(new_state, inner_state), scale)

    def cond_on_state_select_updates(params, state, grads):
        # The state under a cond, the updates selected outside it.
        inner_state, scale = state
        unscaled = jax.tree.map(lambda g: g / scale, grads)
        finite = _finite_by_sums(unscaled)
        updates, _ = inner.update(unscaled, inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, -0.0), updates)
        new_state = jax.lax.cond(
            finite, lambda: inner.update(unscaled, inner_state, params)[1], lambda: inner_state
        )
        return optax.apply_updates(params, updates), (new_state, scale)

    def cond_with_booleans(params, state, grads):
        # The shipped cond, with the check written as isfinite(x).all() per leaf.
        inner_state, scale = state
        finite = _finite_by_booleans(jax.tree.map(lambda g: g / scale, grads))

        def apply():
            return inner.update(jax.tree.map(lambda g: g / scale, grads), inner_state, params)

        updates, new_state = jax.lax.cond(
            finite, apply, lambda: (_skip_updates(apply), inner_state)
        )
        return optax.apply_updates(params, updates), (new_state, scale)

    def cond_without_check(params, state, grads):
        # Not a valid step: a cond on a predicate that costs nothing, to price the cond alone.
        inner_state, scale = state

        def apply():
            return inner.update(jax.tree.map(lambda g: g / scale, grads), inner_state, params)

        updates, new_state = jax.lax.cond(
            scale > 0, apply, lambda: (_skip_updates(apply), inner_state)
        )
        return optax.apply_updates(params, updates), (new_state, scale)

    def unscale_alone(params, state, grads):
        # Not a valid step: unscaled and applied, neither checked nor skipped.
        inner_state, scale = state
        updates, new_state = inner.update(
            jax.tree.map(lambda g: g / scale, grads), inner_state, params
        )
        return optax.apply_updates(params, updates), (new_state, scale)

    def check_without_skip(params, state, grads):
        # Not a valid step: the finite check only adjusts the scale, nothing is skipped.
        inner_state, scale = state
        unscaled = jax.tree.map(lambda g: g / scale, grads)
        updates, new_state = inner.update(unscaled, inner_state, params)
        scale = jnp.where(_finite_by_sums(unscaled), scale, scale / 2)
        return optax.apply_updates(params, updates), (new_state, scale)

    tx = jls.loss_scaled(inner, jls.DynamicLossScale(initial_loss_scale=SCALE))

    def shipped(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def bare(params, inner_state, grads):
        updates, inner_state = inner.update(grads, inner_state, params)
        return optax.apply_updates(params, updates), inner_state

    with_scale = lambda params: (inner.init(params), jnp.float32(SCALE))  # noqa: E731
    return {
        "bare": (bare, inner.init, False),
        "loss_scaled (cond, check by sums)": (shipped, tx.init, True),
        "cond, check by booleans": (cond_with_booleans, with_scale, True),
        "cond on state, select updates": (cond_on_state_select_updates, with_scale, True),
        "select everything (no cond)": (select_everything, with_scale, True),
        "select updates and state (no cond)": (select_updates_and_state, with_scale, True),
        "select, check by booleans (jmp)": (select_with_booleans, with_scale, True),
        "unscale alone (invalid)": (unscale_alone, with_scale, True),
        "cond alone (no check; invalid)": (cond_without_check, with_scale, True),
        "check alone (no skip; invalid)": (check_without_skip, with_scale, True),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.formulations")
    parser.add_argument("--platform", default=None, help="cpu, gpu or tpu; default: JAX's")
    parser.add_argument("--params", type=int, default=8_000_000)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument(
        "--optimizer", default="adam", choices=list(OPTIMIZERS), help="the inner optimizer"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="time trace + lower + compile (median of --repeats) instead of the step",
    )
    args = parser.parse_args(argv)
    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    inner = OPTIMIZERS[args.optimizer]()
    if args.compile:
        return _compile_times(inner, args)
    params, grads = params_and_grads(args.params, args.leaves)
    scaled = jax.tree.map(lambda g: g * SCALE, grads)
    runners = {
        name: Runner(step, init, params, scaled if scales else grads)
        for name, (step, init, scales) in formulations(inner).items()
    }
    medians, faults = block_medians(runners, args.repeats, args.block)
    bare = medians["bare"]
    print(f"{_title(args)}, {jax.devices()[0]}")
    print("formulation | median | ratio to bare | XLA temp memory | page faults per step")
    for name, runner in runners.items():
        print(
            f"{name} | {medians[name] * 1e3:.2f} ms | {medians[name] / bare:.2f}x | "
            f"{runner.temp_bytes / 2**20:.1f} MiB | {faults[name]:.0f}"
        )
    return medians


def _compile_times(inner, args) -> dict[str, float]:
    params, grads = params_and_grads(args.params, args.leaves)
    steps = formulations(inner)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):  # the formulations take turns
        for name, (step, init, _) in steps.items():
            jax.clear_caches()
            state = jax.eval_shape(init, params)
            start = time.perf_counter()
            jax.jit(step, donate_argnums=(0, 1)).trace(params, state, grads).lower().compile()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{_title(args)}: trace + lower + compile, {jax.devices()[0]}")
    print("formulation | median | ratio to bare")
    for name, median in medians.items():
        print(f"{name} | {median:.2f} s | {median / medians['bare']:.2f}x")
    return medians


def _title(args) -> str:
    return f"{args.optimizer}, {args.params / 1e6:g}M params in {args.leaves} leaves"


if __name__ == "__main__":
    main()
