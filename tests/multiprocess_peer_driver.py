"""One process of tests/test_multiprocess_peers.py's 2-process launch (not a test module itself).

Launched with TLT_JAX_COORDINATOR / TLT_JAX_NUM_PROCESSES / TLT_JAX_PROCESS_ID, a short
TLT_JAX_HEARTBEAT_TIMEOUT and XLA_FLAGS=--xla_force_host_platform_device_count=2:

  python tests/multiprocess_peer_driver.py
      joins the job, then runs a tiny model's rollout on the global 4-device data mesh twice: without and
      with the spot trainer in `idle_devices` mode (rows end at different steps: devices whose rows all
      ended train the drafter while the others decode, one SPMD program over both processes). Prints one
      RESULT line (both rollouts' tokens and lengths, each tick's live rows and per-device gradient norms,
      whether the drafter moved), then READY, then waits: the test SIGKILLs process 1 and times how long
      process 0 lives on (JAX's coordination service ends it after the heartbeat timeout).
"""

from __future__ import annotations

import json
import time

import numpy as np
from multiprocess_driver import EOS_IDS, PROMPTS  # tests/ is this script's directory

from tlt_jax.utils import distributed


def spot_check() -> dict:
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
    engine = RolloutEngine(
        model, cfg, eos_ids=EOS_IDS, mesh=shd.make_mesh(), drafter=Drafter(model.cfg, nnx.Rngs(1))
    )
    spot_cfg = dict(micro_steps=2, rows=2, window=16, context=8, ce_tokens=16, ttt_steps=1, ttt_positions=8)
    spot = SpotTrainer(
        SpotConfig(mode="idle_devices", eval_samples=4, **spot_cfg), Drafter(model.cfg, nnx.Rngs(1)), engine
    )
    ticks: list[tuple[list[int], list[float]]] = []
    work = spot.idle_work

    def recording(live: tuple[int, ...]):  # noqa: ANN202  each tick: live rows per shard, grad norms
        w = work(live)
        if w is None:
            return None

        def on_done(outputs, seconds) -> None:  # noqa: ANN001
            w.on_done(outputs, seconds)
            ticks.append((list(live), [float(x) for x in spot.last_device_grad_norms]))

        return type(w)(w.key, w.fn, w.operands, w.in_specs, w.out_specs, on_done)

    spot.idle_work = recording
    key, sampling = jax.random.key(3), SamplingParams(1.0)
    plain = engine.generate(PROMPTS, n=4, key=key, sampling=sampling)
    before = [np.asarray(x) for x in jax.tree.leaves(shd.to_host_tree(spot.params))]
    spot.begin_step(1)
    out = engine.generate(PROMPTS, n=4, key=key, sampling=sampling, hooks=[spot])
    after = [np.asarray(x) for x in jax.tree.leaves(shd.to_host_tree(spot.params))]
    return {
        "process_index": jax.process_index(),
        "device_count": jax.device_count(),
        "plain": [np.asarray(plain.tokens).tolist(), np.asarray(plain.lengths).tolist()],
        "spot": [np.asarray(out.tokens).tolist(), np.asarray(out.lengths).tolist()],
        "ticks": ticks,
        "spot_steps": int(shd.to_host(spot.state.step)),
        "drafter_moved": max(float(np.abs(a - b).max()) for a, b in zip(before, after, strict=True)),
    }


if __name__ == "__main__":
    distributed.initialize()
    print("RESULT " + json.dumps(spot_check()), flush=True)
    print("READY", flush=True)
    time.sleep(600)  # until the test kills process 1 and JAX's coordination service ends this one
