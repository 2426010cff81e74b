"""Write reasoning-gym problems as a parquet file in VeRL's layout, the data a VeRL user brings.

    python -m tlt_jax.tasks.write_parquet --dataset chain_sum --size 2000 --out data/chain_sum.parquet \\
        --dataset-kwargs '{"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}'
    python -m tlt_jax.tasks.write_parquet --dataset chain_sum --size 64 --seed 1 --split test \\
        --out data/chain_sum_test.parquet --dataset-kwargs '...'

Each row: `data_source` (`--data-source`, default "reasoning_gym/<dataset>"; "math_dapo" makes rows that
`task.reward=verl` scores with DAPO's `Answer:` check, the format the default instruction asks for), `prompt`
(chat messages: an optional system message, then the question followed by `--instruction`, as VeRL's
preprocessing scripts write it), `ability`, `reward_model` {style: "rule", ground_truth}, `extra_info` {split,
index}. Train on it with `--config.task.kind=parquet --config.task.path=data/chain_sum.parquet` (task.layout
"auto" finds "verl").
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Mapping

from tlt_jax.tasks.base import DEFAULT_INSTRUCTION


def verl_rows(
    dataset: str,
    size: int,
    seed: int,
    dataset_kwargs: Mapping[str, object] | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    system: str = "",
    split: str = "train",
    data_source: str = "",
) -> list[dict]:
    """`size` reasoning-gym problems of `dataset` as VeRL rows (module docstring)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **dict(dataset_kwargs or {}))
    rows = []
    for i in range(size):
        entry = ds[i]
        user = f"{entry['question']}\n\n{instruction}" if instruction else str(entry["question"])
        prompt = [{"role": "system", "content": system}] if system else []
        prompt.append({"role": "user", "content": user})
        rows.append(
            {
                "data_source": data_source or f"reasoning_gym/{dataset}",
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_parquet_file(rows: list[dict], out: str | pathlib.Path, row_group_size: int = 1024) -> pathlib.Path:
    """Write rows as one parquet file (parent folders created)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def main(argv: list[str] | None = None) -> pathlib.Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="chain_sum", help="a reasoning-gym dataset name")
    ap.add_argument("--size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset-kwargs", default="{}", help="JSON: the dataset's config fields")
    ap.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="appended to each question ('' none)")
    ap.add_argument("--system", default="", help="a system message for every prompt ('' none)")
    ap.add_argument("--split", default="train", help="extra_info.split")
    ap.add_argument("--data-source", default="", help="the rows' data_source ('' = reasoning_gym/<dataset>)")
    ap.add_argument("--out", required=True, help="the parquet file to write")
    args = ap.parse_args(argv)
    rows = verl_rows(
        args.dataset,
        args.size,
        args.seed,
        json.loads(args.dataset_kwargs),
        args.instruction,
        args.system,
        args.split,
        args.data_source,
    )
    path = write_parquet_file(rows, args.out)
    print(f"wrote {len(rows)} {args.dataset} problems in VeRL's layout to {path}")
    return path


if __name__ == "__main__":
    main()
