"""Test configuration: JAX gets 8 CPU devices, set before any backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
