"""Benchmarks of jax_lossscale against the bare optimizer and its peers.

Run `python -m benchmarks --help`.
"""
