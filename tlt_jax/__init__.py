"""tlt_jax: TLT (Taming the Long Tail) adaptive speculative rollouts for GRPO, in JAX/Flax."""

__version__ = "0.1.0"
