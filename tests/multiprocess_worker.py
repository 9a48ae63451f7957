"""One process of the multi-process test in `test_distributed.py`.

Run as `python multiprocess_worker.py --process-id I --num-processes N --port P --output F`:
joins a `jax.distributed` job on 127.0.0.1 with CPU devices, runs a few steps of a jitted,
loss-scaled train step over a global mesh with the data and `w` sharded across processes,
and writes what this process saw as JSON to F. Importing it runs nothing: the test imports
the model and the data from here to compute the single-process reference.

The model keeps the processes' gradients apart: row i of `w`'s gradient is row i of `x`,
held by the device that holds row i of `w`, and the replicated `b`'s gradient comes from
`y` alone. An overflow injected into the injecting process's rows of `x` thus reaches only
that process's shards of the gradients; the other process skips only if the finite check
really spans both processes.
"""

import argparse
import hashlib
import json
import os

import numpy as np

AXIS = "d"
NUM_STEPS = 6
W_ROWS = 8
W_COLS = 3
Y_ROWS = 8
INJECTING_PROCESS = 1
# Steps on which INJECTING_PROCESS puts a non-finite value in its own rows of `x`.
OVERFLOW_STEPS = {1: np.inf, 4: np.nan}


def make_loss_scale():
    import jax_lossscale as jls

    return jls.DynamicLossScale(initial_loss_scale=2.0**10, increment_period=2, multiplier=2.0)


def make_tx():
    import optax

    import jax_lossscale as jls

    return jls.loss_scaled(optax.adam(0.125), make_loss_scale())


def init_params() -> dict[str, np.ndarray]:
    w = (np.arange(W_ROWS * W_COLS, dtype=np.float32).reshape(W_ROWS, W_COLS) - 7.0) / 4.0
    b = np.array([0.5, -1.0, 2.0], np.float32)
    return {"b": b, "w": w}


def global_batch(step: int) -> dict[str, np.ndarray]:
    """The batch of `step`, small integers so that sums are exact in any order."""
    rng = np.random.default_rng(step)
    return {
        "x": rng.integers(-4, 5, size=(W_ROWS, W_COLS)).astype(np.float32),
        "y": rng.integers(-4, 5, size=(Y_ROWS, W_COLS)).astype(np.float32),
    }


def process_batch(step: int, process_id: int, num_processes: int) -> dict[str, np.ndarray]:
    """The rows of the global batch that `process_id` feeds, with the injected overflow."""
    local = {}
    for name, value in global_batch(step).items():
        rows = len(value) // num_processes
        local[name] = value[process_id * rows : (process_id + 1) * rows].copy()
    if process_id == INJECTING_PROCESS and step in OVERFLOW_STEPS:
        local["x"][0, 0] = OVERFLOW_STEPS[step]
    return local


def reference_batch(step: int, num_processes: int) -> dict[str, np.ndarray]:
    """The global batch as the processes assemble it, overflows included."""
    parts = [process_batch(step, i, num_processes) for i in range(num_processes)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def loss_fn(params, batch):
    import jax.numpy as jnp

    return jnp.sum(params["w"] * batch["x"]) + jnp.sum(params["b"] * batch["y"].sum(0))


def make_train_step(tx):
    """A jitted step returning the new params, the new state and the scaled gradients."""
    import jax
    import optax

    import jax_lossscale as jls

    def train_step(params, opt_state, batch):
        scale = jls.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    return jax.jit(train_step)


def _local_value(array) -> np.ndarray:
    """This process's own copy of a replicated array (not a gathered one)."""
    return np.asarray(array.addressable_data(0))


def _locally_finite(array) -> bool:
    """Whether the shards of `array` on this process's devices hold only finite values."""
    return all(bool(np.isfinite(np.asarray(s.data)).all()) for s in array.addressable_shards)


def _scalars(named_tuple) -> dict[str, float | int | bool]:
    return {k: _local_value(v).item() for k, v in named_tuple._asdict().items()}


def _shardings_kept(params, opt_state, param_shardings) -> dict[str, bool]:
    """Whether params and adam's `mu` and `nu` still have the shardings params started with."""
    adam_state = opt_state.inner_state[0]
    trees = {"params": params, "mu": adam_state.mu, "nu": adam_state.nu}
    return {
        f"{tree_name}.{name}": tree[name].sharding.is_equivalent_to(sharding, tree[name].ndim)
        for tree_name, tree in trees.items()
        for name, sharding in param_shardings.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--local-devices", type=int, default=2)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import jax_lossscale as jls

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    sharded = NamedSharding(mesh, PartitionSpec(AXIS))
    replicated = NamedSharding(mesh, PartitionSpec())
    param_shardings = {"b": replicated, "w": sharded}

    # Each device gets its rows of the global params, wherever the mesh puts it.
    params = {
        name: jax.make_array_from_callback(value.shape, param_shardings[name], value.__getitem__)
        for name, value in init_params().items()
    }
    tx = make_tx()
    opt_state = jax.jit(tx.init)(params)
    train_step = make_train_step(tx)

    applied, scales, local_grads_finite = [], [], []
    for step in range(NUM_STEPS):
        local = process_batch(step, args.process_id, args.num_processes)
        batch = {
            name: jax.make_array_from_process_local_data(
                sharded, value, (len(value) * args.num_processes, W_COLS)
            )
            for name, value in local.items()
        }
        params, opt_state, grads = train_step(params, opt_state, batch)
        stats = jls.get_loss_scale_stats(opt_state)
        applied.append(bool(_local_value(stats.last_step_applied)))
        scales.append(float(_local_value(stats.loss_scale)))
        local_grads_finite.append({name: _locally_finite(g) for name, g in grads.items()})

    gathered = multihost_utils.process_allgather(params, tiled=True)
    digest = hashlib.sha256()
    for name in sorted(gathered):
        digest.update(np.ascontiguousarray(gathered[name], np.float32).tobytes())
    result = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "applied": applied,
        "scales": scales,
        "local_grads_finite": local_grads_finite,
        "loss_scale_state": _scalars(opt_state.loss_scale_state),
        "stats": _scalars(jls.get_loss_scale_stats(opt_state)),
        "local_b": _local_value(params["b"]).tolist(),
        "params": {name: value.tolist() for name, value in gathered.items()},
        "params_sha256": digest.hexdigest(),
        "shardings_kept": _shardings_kept(params, opt_state, param_shardings),
    }
    with open(args.output, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
