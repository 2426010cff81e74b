"""Micro-benchmarks of one part of tlt_jax: decoding, speculative rounds, sampling, kernels, compilation."""
