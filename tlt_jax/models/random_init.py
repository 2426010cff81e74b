"""Random weights born on the devices: abstract shapes, a jitted init with sharded outputs, no host copy.

A Qwen2.5-7B in float32 is 30 GB, more than a host here holds: its weights must never pass through the host.
The module is first built abstractly (`nnx.eval_shape`: shapes and dtypes, no arrays); the caller's sharding
rule (`ShardFn`, e.g. `tlt_jax.sharding.param_shardings` over a mesh: this layer cannot import it) turns the
shapes into shardings; a jitted init with those `out_shardings` then draws every weight on its own devices
(threefry is partitionable: each device draws only its shard). The values are the modules' own init (normal,
std 0.02; norms one; biases zero): meaningless as a language model, exact for anything that only times a pass
or measures memory, since neither depends on the weights' values. `NoTextTokenizer` stands in for the
tokenizer such a model does not have: every text path it reaches fails with the fix.

    params_sds = abstract_params(lambda: Transformer(cfg, nnx.Rngs(0)), shard_fn)[1]  # memory plans
    model = random_model(cfg, seed, shard_fn)                                          # timing
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.tasks.synthetic import StopIds

# a parameter State of ShapeDtypeStructs -> a pytree of `jax.sharding.Sharding`s of the same structure
ShardFn = Callable[[Any], Any]


def abstract_params(make: Callable[[], nnx.Module], shard_fn: ShardFn | None = None) -> tuple[Any, Any]:
    """(graphdef, parameter State of `jax.ShapeDtypeStruct`s) of the module `make()` builds, without building
    it; with `shard_fn`, every struct carries its sharding (ready for `jit(...).lower`)."""
    graphdef, params = nnx.split(nnx.eval_shape(make), nnx.Param)
    if shard_fn is None:
        return graphdef, params
    shardings = shard_fn(params)
    return graphdef, jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings
    )


def init_on_devices(make: Callable[[], nnx.Module], shard_fn: ShardFn | None = None) -> nnx.Module:
    """The module `make()` builds, its parameters initialised by one jitted program whose outputs are laid
    out by `shard_fn` (default: the default device), so no weight is ever materialised on the host."""
    graphdef, params = abstract_params(make, shard_fn)
    shardings = None if shard_fn is None else jax.tree.map(lambda a: a.sharding, params)
    init = jax.jit(lambda: nnx.state(make(), nnx.Param), out_shardings=shardings)
    return nnx.merge(graphdef, init())


def random_model(cfg: ModelConfig, seed: int = 0, shard_fn: ShardFn | None = None) -> Transformer:
    """A `Transformer` of `cfg` with random weights drawn on the devices (see the module docstring)."""
    return init_on_devices(lambda: Transformer(cfg, nnx.Rngs(params=seed)), shard_fn)


def random_drafter(target_cfg: ModelConfig, seed: int = 1, shard_fn: ShardFn | None = None) -> Drafter:
    """An EAGLE `Drafter` for a target of `target_cfg` (fc + one decoder layer; the embedding and head are
    the target's) with random weights drawn on the devices."""
    return init_on_devices(lambda: Drafter(target_cfg, nnx.Rngs(params=seed)), shard_fn)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded arrays or ShapeDtypeStructs (the largest shard of each
    leaf; an unsharded struct counts whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


class NoTextTokenizer(StopIds):
    """The tokenizer of a model with random weights: ids and stop tokens for the engine, no text.

    `vocab_size` and `eos_token_ids` are what the rollout engine needs; every method that maps between ids
    and text raises a ValueError that names the problem (random weights produce no meaningful text: rewards,
    chat prompts and warm-up data from text would be noise) and the fix (real weights).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int], what: str, fix: str) -> None:
        super().__init__(vocab_size, eos_token_ids)
        self.what, self.fix = what, fix

    def _refuse(self, op: str) -> None:
        raise ValueError(
            f"tokenizer.{op}: {self.what} has random weights (config.model.init=random) and no tokenizer: "
            "it is for timing and memory, not text (rewards, chat prompts, data from text would be noise). "
            + self.fix
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self._refuse("encode")

    def encode_batch(self, texts: Any, add_special_tokens: bool = False) -> list[list[int]]:
        self._refuse("encode_batch")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        self._refuse("decode")

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> str:
        self._refuse("apply_chat_template")

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True) -> list[int]:
        self._refuse("encode_chat")

    def token_to_id(self, token: str) -> int | None:
        self._refuse("token_to_id")

    def id_to_token(self, token_id: int) -> str | None:
        self._refuse("id_to_token")

    def save(self, directory: Any) -> None:
        self._refuse("save")

    def __repr__(self) -> str:
        return f"NoTextTokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"
