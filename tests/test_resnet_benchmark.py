"""The ResNet benchmark's three pmap'ed train steps agree, skip an inf batch, and run end to end.

A tiny ResNet18 (4 filters, 8x8 images, 2 images per device) on 2 of the 8 CPU devices. The
scaled contenders start at a loss scale of 1024 here: flax's default 65536 overflows this tiny
model's float16 backward pass on its first steps (checked below too), so no step would apply.
"""

import json

import jax
import numpy as np
import pytest

import jax_lossscale as jls
from benchmarks import resnet

FILTERS, IMAGE, PER_DEVICE = 4, 8, 2
SCALED = ("flax DynamicScale", "jax_lossscale")


def host_copy(tree):
    return jax.tree.map(np.array, tree)  # a copy: the steps donate their state


def momentum_of(contender, state):
    opt_state = state["opt_state"]
    return opt_state.inner_state if contender == "jax_lossscale" else opt_state


@pytest.fixture(scope="module")
def devices():
    return jax.local_devices()[:2]


@pytest.fixture(scope="module")
def batches(devices):
    good = [resnet.fake_batch(2 * PER_DEVICE, IMAGE, seed=seed) for seed in (0, 1)]
    bad = resnet.fake_batch(2 * PER_DEVICE, IMAGE, seed=2)
    bad["image"][1, 3, 4, 2] = np.inf  # one inf pixel, on the first device
    return [resnet.shard(batch, devices) for batch in [*good, bad]]


@pytest.fixture(scope="module")
def steps(devices):
    """Each contender's pmap'ed step, compiled once for the module."""
    return {
        contender: resnet.pmapped(resnet.build(contender, FILTERS, IMAGE, devices)[0], devices)
        for contender in resnet.CONTENDERS
    }


def trajectory(steps, devices, batches, scale):
    """Host copies of each contender's state before and after every batch, and its metrics."""
    states, metrics = {}, {}
    for contender, step in steps.items():
        state = resnet.build(contender, FILTERS, IMAGE, devices, scale=scale)[1]
        states[contender], metrics[contender] = [host_copy(state)], []
        for batch in batches:
            state, step_metrics = step(state, batch)
            states[contender].append(host_copy(state))
            metrics[contender].append(host_copy(step_metrics))
    return states, metrics


@pytest.fixture(scope="module")
def run_1024(steps, devices, batches):
    return trajectory(steps, devices, batches, scale=1024.0)


def test_two_finite_batches_train_alike(run_1024):
    states, metrics = run_1024
    for contender in resnet.CONTENDERS:
        for index in (1, 2):
            for leaf in jax.tree.leaves(states[contender][index]):
                assert np.all(np.isfinite(leaf)), contender
        assert np.isfinite(metrics[contender][1]["loss"]).all()
    for contender in SCALED:
        assert resnet.scale_of(contender, states[contender][2]) == 1024.0
    start = states["bare"][0]["params"]
    bare = states["bare"][2]["params"]
    changed = jax.tree.map(lambda new, old: bool(np.any(new != old)), bare, start)
    # The second step (warm-up lr 0.02; the first has lr 0) moves 46 of the 62 leaves: not the
    # first BatchNorm of each of the 8 blocks, whose gradient is 0 behind the block's second
    # BatchNorm (scale initialised to 0) and which has no weight decay (1-D leaves).
    assert sum(jax.tree.leaves(changed)) == 62 - 2 * 8
    for contender in SCALED:  # each leaf's change agrees with bare's to 4e-5 (float16 rounding)
        scaled = states[contender][2]["params"]
        jax.tree.map(
            lambda a, b, s: np.testing.assert_allclose(a - s, b - s, rtol=1e-2, atol=1e-6),
            scaled,
            bare,
            start,
        )
        jax.tree.map(  # the forward pass does not see the scale
            np.testing.assert_array_equal,
            states[contender][2]["batch_stats"],
            states["bare"][2]["batch_stats"],
        )
    # flax's step and the migrated one agree to the bit: the same scale, a power of 2
    jax.tree.map(
        np.testing.assert_array_equal,
        states["flax DynamicScale"][2]["params"],
        states["jax_lossscale"][2]["params"],
    )


def test_an_inf_pixel_leaves_the_scaled_steps_state_bit_for_bit(run_1024):
    states, metrics = run_1024
    for contender in SCALED:
        before, after = states[contender][2], states[contender][3]
        jax.tree.map(np.testing.assert_array_equal, after["params"], before["params"])
        jax.tree.map(
            np.testing.assert_array_equal,
            momentum_of(contender, after),
            momentum_of(contender, before),
        )
        jax.tree.map(np.testing.assert_array_equal, after["batch_stats"], before["batch_stats"])
        assert resnet.scale_of(contender, after) == 512.0
        np.testing.assert_array_equal(
            metrics[contender][2]["scale"], [512.0, 512.0]
        )  # both devices
    stats = jls.get_loss_scale_stats(states["jax_lossscale"][3]["opt_state"])
    np.testing.assert_array_equal(stats.skipped_steps, [1, 1])
    np.testing.assert_array_equal(stats.inf_skipped_steps + stats.nan_skipped_steps, [1, 1])
    # without loss scaling the same batch reaches the statistics: what the others keep out
    bare_stats = jax.tree.leaves(states["bare"][3]["batch_stats"])
    assert all(np.isnan(leaf).all() for leaf in bare_stats)


def test_flax_default_scale_backs_off_alike_in_both(steps, devices, batches):
    states, _ = trajectory(steps, devices, batches[:2], scale=65536.0)
    for contender in SCALED:
        for index, scale in [(1, 32768.0), (2, 16384.0)]:
            assert resnet.scale_of(contender, states[contender][index]) == scale
        jax.tree.map(
            np.testing.assert_array_equal,
            states[contender][2]["params"],
            states[contender][0]["params"],
        )


def test_main_writes_the_three_contenders_ratios(tmp_path, capsys):
    path = tmp_path / "resnet.json"
    argv = ["--filters", "4", "--image", "8", "--batch", "2", "--repeats", "1", "--block", "2"]
    results = resnet.main([*argv, "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    assert results["command"] == "python -m benchmarks.resnet " + " ".join(
        [*argv, "--out", str(path)]
    )
    assert results["machine"]["backend"] == "cpu"
    [row] = results["rows"]
    assert row["optimizer"] == "sgd nesterov, ResNet18 f4, 8px, batch 2x2"
    assert list(row["values"]) == list(resnet.CONTENDERS)
    assert row["ratio_to_bare"]["bare"] == 1.0
    assert all(value > 0 for value in row["values"].values())
    assert set(row["ratio_to_bare"]) == set(resnet.CONTENDERS)
    # flax's 65536 overflows this tiny model's first steps (see above); 3 calls back it off 3 times
    assert row["final_scale"] == {"flax DynamicScale": 8192.0, "jax_lossscale": 8192.0}
    assert row["leaves"] == 62
    printed = capsys.readouterr().out
    assert "## resnet_step (s, ratio to bare)" in printed
    assert "optimizer | params | leaves | bare | flax DynamicScale | jax_lossscale" in printed
