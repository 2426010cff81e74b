"""`plain_dict`: nested ConfigDicts at any depth (also inside dicts, lists and tuples) become plain data."""

import json

import ml_collections as mlc

from tlt_jax.utils.plain import plain_dict


def test_nested_config_dicts_inside_plain_dicts_become_json_serialisable() -> None:
    inner = mlc.ConfigDict({"min_terms": 2, "deep": mlc.ConfigDict({"x": (1, 2)})})
    top = {"kind": "reasoning_gym", "dataset_kwargs": inner, "arms": [mlc.ConfigDict({"a": 1})]}
    out = plain_dict(top)
    assert out == {
        "kind": "reasoning_gym",
        "dataset_kwargs": {"min_terms": 2, "deep": {"x": (1, 2)}},
        "arms": [{"a": 1}],
    }
    assert json.loads(json.dumps(out, sort_keys=True))["dataset_kwargs"]["deep"] == {"x": [1, 2]}
    assert (
        plain_dict(mlc.FrozenConfigDict(mlc.ConfigDict({"t": {"dataset_kwargs": inner}})))["t"][
            "dataset_kwargs"
        ]["min_terms"]
        == 2
    )
