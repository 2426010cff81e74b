"""The decoder stack's two layouts (`tlt_jax.models.llama`): unrolled (`layers` a list of `DecoderLayer`: the
rollout engine's) and stacked (`layers` one `DecoderLayer` with [L]-leading weights, run as one scan: the
trainer's when config.trainer.scan_layers is on). Converts parameter states, optimizer moments, models and
graph definitions between them, on concrete arrays, under jit and on abstract shapes alike."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.llama import Transformer


def _map_params(fn: Callable, params: nnx.State) -> nnx.State:
    """`fn` on concrete arrays, `jax.eval_shape(fn)` on abstract ones (memory plans, nothing materialised)."""
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    return jax.eval_shape(fn, params) if abstract else fn(params)


def stack_layers(params: nnx.State) -> nnx.State:
    """A Transformer's parameter state in the unrolled layout -> the stacked one (`layers` {i: layer} -> one
    layer whose leaves are [L, ...]). Works under jit and on abstract states; a stacked state is returned."""
    layers = params["layers"]
    if not all(isinstance(k, int) for k in layers):
        return params

    def stack(p: nnx.State) -> nnx.State:
        per_layer = [p["layers"][i] for i in range(len(p["layers"]))]
        out = nnx.State(dict(p.raw_mapping))  # State.__setitem__ stores a State's raw mapping
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        return out

    return _map_params(stack, params)


def unstack_layers(params: nnx.State) -> nnx.State:
    """The stacked layout's parameter state -> the unrolled one (`stack_layers` reversed); an unrolled state
    is returned as it is."""
    layers = params["layers"]
    if all(isinstance(k, int) for k in layers):
        return params

    def unstack(p: nnx.State) -> nnx.State:
        n = jax.tree.leaves(p["layers"])[0].shape[0]
        out, layers = nnx.State(dict(p.raw_mapping)), nnx.State({})
        for i in range(n):
            layers[i] = jax.tree.map(lambda x, i=i: x[i], p["layers"])
        out["layers"] = layers
        return out

    return _map_params(unstack, params)


def to_layout(tree: object, stacked: bool) -> object:
    """Every Transformer parameter state inside `tree` (the params, an optimizer's params-shaped moments)
    converted to the stacked or the unrolled layout; the rest of `tree` as it is."""
    convert = stack_layers if stacked else unstack_layers
    is_model = lambda x: isinstance(x, nnx.State) and "layers" in x  # noqa: E731
    return jax.tree.map(lambda x: convert(x) if is_model(x) else x, tree, is_leaf=is_model)


def unrolled(model: Transformer) -> Transformer:
    """`model` in the unrolled layout (itself if it is; else a new module holding per-layer copies)."""
    if not model.stacked:
        return model
    return nnx.merge(layout_graphdef(model.cfg, False), unstack_layers(nnx.state(model, nnx.Param)))


def layout_graphdef(cfg: ModelConfig, stacked: bool) -> nnx.GraphDef:
    """The graph definition of a Transformer of `cfg` in the given layout (for `nnx.merge` with a state
    converted by `stack_layers` / `unstack_layers`); nothing is materialised."""
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0), stacked=stacked)))
