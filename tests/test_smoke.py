import jax


def test_eight_cpu_devices():
    assert jax.device_count() == 8
    assert {d.platform for d in jax.devices()} == {"cpu"}
