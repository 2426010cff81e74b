"""Plain data from config objects: one conversion for config.json, wandb, the workdir check and the typed
config sections, so no caller needs to know which sections nest (a `dict()` of a ConfigDict converts only its
top level and leaves nested ConfigDicts that `json.dumps` refuses)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections as mlc


def plain_dict(config: mlc.ConfigDict | mlc.FrozenConfigDict | Mapping[str, object]) -> dict[str, Any]:
    """A ConfigDict / FrozenConfigDict / Mapping, nested to any depth (also inside lists and tuples), as plain
    dicts, lists and tuples of its leaves."""
    out = plain_value(config)
    if not isinstance(out, dict):
        raise TypeError(f"expected a ConfigDict or a mapping, got {type(config).__name__}")
    return out


def plain_value(value: Any) -> Any:
    """`value` with every ConfigDict or Mapping inside it (at any depth) turned into a plain dict."""
    if hasattr(value, "to_dict"):  # ml_collections' ConfigDict and FrozenConfigDict are not Mappings
        value = value.to_dict()
    if isinstance(value, Mapping):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_value(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_value(v) for v in value)
    return value
