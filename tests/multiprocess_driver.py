"""One process of the multi-process checks in tests/test_multiprocess.py (not a test module itself).

Launched with TLT_JAX_COORDINATOR / TLT_JAX_NUM_PROCESSES / TLT_JAX_PROCESS_ID and
XLA_FLAGS=--xla_force_host_platform_device_count=2.

  python tests/multiprocess_driver.py
      joins the job through tlt_jax.utils.distributed, builds the global (data) mesh over every process's
      devices, and prints one JSON line with what it sees and the result of two cross-process collectives (a
      jitted sum of a data-sharded array and a psum in shard_map), what tlt_jax.sharding's host helpers
      return for arrays spanning both processes (`to_host`, `put_global`), and the arms a BEG-MAB selector
      plays when each process measures different speeds (BANDIT_SPEEDS).
  python tests/multiprocess_driver.py spot
      a rollout of a tiny model on the global data mesh whose rows end at different steps (EOS_IDS), with
      the spot trainer in `idle_devices` mode: devices whose rows all ended train the drafter while the
      others decode, one SPMD program over both processes. Prints the tokens, lengths, trained ticks and
      drafter parameter sums. Without launch variables it runs as one process (the reference).
"""

from __future__ import annotations

import json

import numpy as np

from tlt_jax.utils import distributed

# tokens/s each process measures for each arm of the selector (plain, 3_1_4), per process: alone, process 0
# would settle on plain and process 1 on 3_1_4; both must play the arms of the mean (80 and 100)
BANDIT_SPEEDS = ((100.0, 80.0), (60.0, 120.0))
BANDIT_CHUNKS = 12


def bandit_arms(speeds: tuple[tuple[float, float], ...]) -> tuple[list[str], list[float]]:
    """The arms a BEG-MAB selector plays over BANDIT_CHUNKS chunks at 4 rows when process p measures
    speeds[p] (tokens/s of plain, 3_1_4), and the rewards it learned for them (its window, bucket 0)."""
    import jax

    from tlt_jax.rollout.beg_mab import BanditPolicy
    from tlt_jax.rollout.selector_config import SelectorConfig, all_arms_eligibility

    elig = all_arms_eligibility(2, 2)
    cfg = SelectorConfig(("plain", "3_1_4"), (1, 4), (8, 64), eligible=elig, epsilon=0.3, window=16)
    policy = BanditPolicy(cfg, seed=3)
    played = []
    for _ in range(BANDIT_CHUNKS):
        arm = policy.select(4)
        played.append(arm)
        policy.observe(arm, 4, speeds[jax.process_index()][cfg.arm_index(arm)], 2.0)
    rewards = np.asarray(policy.state.rewards)[0]
    return played, [float(r) for r in rewards[~np.isnan(rewards)]]


def disputed_reward(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """A custom reward (VeRL's contract) whose verdict depends on the process that runs it, as a checker's
    wall-clock timeout can (math-verify's 5 s: a borderline row passes in one process, times out in
    another): process 1 fails every row. `scored_by` records which process scored the row."""
    import jax

    del data_source, extra_info
    right = jax.process_index() == 0 and solution_str.strip() == str(ground_truth)
    return {"score": float(right), "acc": right, "scored_by": float(jax.process_index())}


def shared_rewards() -> list[list[float]]:
    """7 responses to 3 problems scored by `rl.reward.score_texts` with `disputed_reward`: each row scored
    by one process (rows p::2) and the verdicts shared, so both processes report the same [reward,
    correct, scored_by] rows (each process scoring every row, they would disagree)."""
    import pathlib
    import tempfile

    from tlt_jax.rl.reward import score_texts
    from tlt_jax.tasks.files import FileTask

    folder = pathlib.Path(tempfile.mkdtemp())
    rows = [{"question": f"{a} + {a}?", "answer": str(2 * a)} for a in (1, 2, 3)]
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = FileTask(
        str(folder / "qa.jsonl"), layout="qa", shuffle=False, reward=f"{__file__}:disputed_reward"
    )
    problems = [task.problem(i) for i in range(3)]
    index = [0, 0, 1, 1, 2, 2, 0]
    texts = ["2", "3", "4", "4", "6", "5", "2"]
    results = score_texts(task, problems, texts, index)
    return [[r.reward, float(r.correct), r.extra["scored_by"]] for r in results]


def collectives() -> None:
    spec = distributed.initialize()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tlt_jax import sharding as shd
    from tlt_jax.utils.preemption import process_max

    mesh = shd.make_mesh()  # every global device on the data axis
    n = jax.device_count()
    values = np.arange(1, n + 1, dtype=np.float32)  # device d holds d + 1
    x = jax.make_array_from_callback((n,), NamedSharding(mesh, P("data")), lambda idx: values[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    psum = jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())(x)
    # the host helpers: the whole of an array sharded over both processes; a process-local state (a typed
    # key included) put on a sharding over both processes' devices
    whole = shd.to_host(x)
    tree = shd.to_host_tree({"x": x, "total": total, "host": values})
    local = {"w": jnp.arange(3.0), "key": jax.random.key(7)}
    put = shd.put_global(local, NamedSharding(mesh, P()))
    played, rewards = bandit_arms(BANDIT_SPEEDS)
    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "spec_process_id": spec.process_id,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh_shape": dict(mesh.shape),
        "local_shards": [float(s.data[0]) for s in x.addressable_shards],
        "sum": float(np.asarray(total)),
        "psum": float(np.asarray(psum)[0]),
        "to_host": whole.tolist(),
        "to_host_tree": {k: np.asarray(v).tolist() for k, v in tree.items()},
        "put_global": {
            "w": shd.to_host(put["w"]).tolist(),
            "key": np.asarray(jax.random.key_data(put["key"])).tolist(),
            "local_key": np.asarray(jax.random.key_data(local["key"])).tolist(),
            "devices": len(put["w"].sharding.device_set),
            "key_devices": len(put["key"].sharding.device_set),
        },
        "bandit_played": played,
        "bandit_rewards": rewards,
        "rewards": shared_rewards(),
        # the stop agreement's collective (utils/preemption.py): each process's own value, the max of all
        "process_max": [process_max(3 + 10 * jax.process_index()), process_max(5 - jax.process_index())],
    }
    print("RESULT " + json.dumps(report), flush=True)


EOS_IDS = list(range(100, 120))  # ~8% of a random model's draws end a row: rows end at different steps
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 44]]


def spot_rollout() -> None:
    import os

    if os.environ.get(distributed.NUM_PROCESSES):
        distributed.initialize()
    import jax
    from flax import nnx

    from tlt_jax import sharding as shd
    from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer
    from tlt_jax.models.config import tiny_config
    from tlt_jax.models.drafter import Drafter
    from tlt_jax.models.llama import Transformer
    from tlt_jax.rollout.engine import RolloutEngine
    from tlt_jax.rollout.interface import EngineConfig
    from tlt_jax.rollout.sampling import SamplingParams

    model = Transformer(tiny_config("llama"), nnx.Rngs(0))
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=2, min_cache_bucket=16, record_hidden=True
    )
    mesh = shd.make_mesh()  # every global device on the data axis
    engine = RolloutEngine(model, cfg, eos_ids=EOS_IDS, mesh=mesh, drafter=Drafter(model.cfg, nnx.Rngs(1)))
    spot_cfg = dict(micro_steps=2, rows=2, window=16, context=8, ce_tokens=16, ttt_steps=1, ttt_positions=8)
    spot = SpotTrainer(
        SpotConfig(mode="idle_devices", eval_samples=4, **spot_cfg), Drafter(model.cfg, nnx.Rngs(1)), engine
    )
    spot.begin_step(1)
    out = engine.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SamplingParams(1.0), hooks=[spot])
    params = jax.tree.leaves(shd.to_host_tree(spot.params))
    report = {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "tokens": np.asarray(out.tokens).tolist(),
        "lengths": np.asarray(out.lengths).tolist(),
        "spot_steps": int(shd.to_host(spot.state.step)),
        "metrics": {
            k: float(v) for k, v in spot.metrics().items() if k in ("spot/steps", "spot/trained_tokens")
        },
        "param_sums": [float(np.asarray(p, np.float64).sum()) for p in params],
    }
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    import sys

    spot_rollout() if sys.argv[1:] == ["spot"] else collectives()
