"""The spot trainer (tlt_jax/drafter/spot_trainer.py) on 8 fake CPU devices and on one device.

idle_devices: 16 rows over a data x model mesh of 4 x 2 (tensor parallelism, the paper's mode: 4 rows per
data group of 2 devices), sampled at T = 1 with 20 EOS ids, so rows end at different steps and groups go
idle one by one while others still decode. Each fused tick must train on exactly the idle groups (their own
gradient non-zero, the busy groups' exactly zero), take the policy's params split over the model axis and
gather none whole, leave the decode results equal to a rollout without the spot trainer, stop when the
rollout ends, and compile nothing new in a second rollout. A data-only mesh across two processes:
tests/test_multiprocess_peers.py; 2 x 4 and 4 x 2 against one device: test_spot_tensor_parallel.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import sharding as shd
from tlt_jax.drafter.chain import shift_left
from tlt_jax.drafter.loss import normalize_metrics
from tlt_jax.drafter.packing import eagle_inputs, pack_samples, to_device
from tlt_jax.drafter.spot_trainer import SpotConfig, SpotTrainer, topk_hits
from tlt_jax.drafter.trainer import TRAIN_STATE_DIR
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import ChunkView, RolloutHooks
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.utils.checkpoint import Checkpointer

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 44]]
EOS = list(range(100, 120))
SP = SamplingParams(temperature=1.0)
SPOT = dict(
    micro_steps=2, rows=2, window=16, context=8, ce_tokens=16, ttt_steps=1, ttt_positions=8, eval_samples=4
)


class Views(RolloutHooks):
    def __init__(self) -> None:
        self.views: list[ChunkView] = []

    def on_chunk(self, view: ChunkView) -> None:
        self.views.append(view)


@pytest.fixture(scope="module")
def model():
    return Transformer(tiny_config("llama"), nnx.Rngs(0))


def engine(model, data: int, tp: int = 1) -> RolloutEngine:
    cfg = EngineConfig(
        max_new_tokens=24, max_cache_len=96, chunk_steps=2, min_cache_bucket=16, record_hidden=True
    )
    mesh = shd.make_mesh(data, tp, jax.devices()[: data * tp])
    return RolloutEngine(model, cfg, eos_ids=EOS, mesh=mesh, drafter=Drafter(model.cfg, nnx.Rngs(1)))


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def gathered_param_shapes(eng: RolloutEngine) -> tuple[set[str], str]:
    """(HLO shapes "f32[a,b]" of the params that the model axis splits, the compiled tick's HLO text)."""
    ticks = [p for k, p in eng.programs._programs.items() if k[0] == "tick"]  # the compiled programs
    assert ticks, "no fused tick program"
    compiled = ticks[-1]
    want = shd.param_shardings(eng.params, eng.mesh)
    got = compiled.input_shardings[0][0]  # the params argument
    split = set()
    for p, w, g in zip(leaves(eng.params), jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert g.is_equivalent_to(w, p.ndim), (g, w)
        if "model" in jax.tree.leaves(tuple(w.spec)):
            split.add(f"{p.dtype.name.replace('float', 'f')}[{','.join(map(str, p.shape))}]")
    return split, compiled.as_text()


def assert_tick_gathers_no_split_param(eng: RolloutEngine) -> None:
    """The fused tick takes the params model-sharded and no all-gather in it rebuilds a whole one."""
    split, hlo = gathered_param_shapes(eng)
    assert split, "no param is split over the model axis"
    results = [line.split(" all-gather(")[0] for line in hlo.splitlines() if " all-gather(" in line]
    gathered = {shape for r in results for shape in re.findall(r"\w+\[[\d,]*\]", r)}  # tuples too
    assert not split & gathered, (split, gathered)


@pytest.mark.devices(8)
def test_idle_devices_train_busy_devices_decode_unchanged(model):
    eng = engine(model, 4, tp=2)
    reference = eng.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SP)
    spot = SpotTrainer(SpotConfig(mode="idle_devices", **SPOT), Drafter(model.cfg, nnx.Rngs(1)), eng)
    ticks: list[tuple[tuple[int, ...], np.ndarray]] = []
    work = spot.idle_work

    def recording_idle_work(live):  # the live rows per shard each tick saw, with its per-device grad norms
        w = work(live)
        if w is None:
            return None
        done = w.on_done

        def on_done(outputs, seconds):
            done(outputs, seconds)
            ticks.append((live, spot.last_device_grad_norms))

        return type(w)(w.key, w.fn, w.operands, w.in_specs, w.out_specs, on_done)

    spot.idle_work = recording_idle_work
    views = Views()
    before = leaves(spot.params)
    spot.begin_step(1)
    out = eng.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SP, hooks=[spot, views])
    # decode results of every device are those of a rollout without the spot trainer
    np.testing.assert_array_equal(out.tokens, reference.tokens)
    np.testing.assert_array_equal(out.lengths, reference.lengths)
    assert len(set(out.lengths.tolist())) > 4, "rows should finish at different steps"
    assert ticks, "no tick trained: no shard was idle while another decoded"
    for live, norms in ticks:
        idle = np.asarray(live) == 0
        assert idle.any() and (~idle).any()
        assert (norms[~idle] == 0).all(), (live, norms)  # busy devices contribute exact zeros
        assert (norms[idle] > 0).all(), (live, norms)  # every idle device trained on its own batch
    # the parameters changed through those updates only: one optimizer step per tick, none after the end
    assert int(spot.state.step) == len(ticks) == spot.metrics()["spot/steps"]
    assert any(np.abs(a - b).max() > 0 for a, b in zip(before, leaves(spot.params), strict=True))
    steps_at_end = int(spot.state.step)
    assert views.views[-1].live_rows == 0
    assert_tick_gathers_no_split_param(eng)
    m = spot.metrics()
    assert m["spot/idle_device_s"] > 0 and m["spot/used_device_s"] > 0 and m["spot/trained_tokens"] > 0
    # used is counted over the same devices and chunks as the idle time on offer, so it cannot exceed it
    assert m["spot/used_device_s"] <= m["spot/idle_device_s"] * (1 + 1e-9), m

    # a second rollout (the next RL step): nothing recompiles, training resumes from the same state
    programs = eng.compile_count
    spot.begin_step(2)
    eng.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SP, hooks=[spot])
    assert eng.compile_count == programs
    assert int(spot.state.step) > steps_at_end


def test_between_chunks_trains_only_in_the_tail_and_reports_its_cost(model, tmp_path):
    eng = engine(model, 1)
    cfg = SpotConfig(mode="between_chunks", threshold=4, steps_per_chunk=1, **SPOT)
    spot = SpotTrainer(cfg, Drafter(model.cfg, nnx.Rngs(1)), eng)
    views = Views()
    spot.begin_step(1)
    untrained = jax.tree.map(jnp.copy, spot.state.params)
    eng.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SP, hooks=[views, spot])
    tail = [v for v in views.views if 0 < v.live_rows <= 4]
    assert tail and any(v.live_rows > 4 for v in views.views)
    # one step after every tail chunk once there was data (the first tail chunks may have none yet)
    assert 0 < spot.metrics()["spot/steps"] <= len(tail)
    assert spot.metrics()["spot/added_seconds"] > 0
    # the staleness probe scored the step's first samples, cut as the buffer cuts them (any length),
    # with the drafter as it was before training on them: its hits and loss are the untrained drafter's on
    # those samples (the spot trainer's own compiled probe and loss), not the trained one's
    assert len(spot._fresh) == cfg.eval_samples and all(x.length <= cfg.seq_len for x in spot._fresh)
    fresh = to_device(pack_samples(spot._fresh, cfg.seq_len, cfg.eval_samples)[0])
    args = (fresh, spot.embed_w, spot.head_w)

    def probe(params) -> tuple[float, float, float]:  # noqa: ANN001
        hits = shd.to_host_tree(spot._probe(spot.trainer.graphdef, params, *args, eng.draft_vocab))
        loss = float(normalize_metrics(shd.to_host_tree(spot._eval(params, *args)))["loss"])
        return float(hits["top1"]) / float(hits["count"]), float(hits["top3"]) / float(hits["count"]), loss

    m = spot.metrics()
    stale = (m["spot/stale_top1"], m["spot/stale_top3"], m["spot/stale_loss"])
    assert stale == pytest.approx(probe(untrained), rel=1e-5), stale
    assert abs(probe(spot.state.params)[2] - stale[2]) > 1e-4  # the trained drafter scores otherwise

    after = SpotTrainer(
        SpotConfig(mode="after_rollout", after_rollout_steps=3, **SPOT), Drafter(model.cfg, nnx.Rngs(1)), eng
    )
    after.begin_step(1)
    eng.generate(PROMPTS, n=4, key=jax.random.key(3), sampling=SP, hooks=[after])
    assert int(after.state.step) == 0  # nothing during the rollout
    after.after_rollout()
    assert int(after.state.step) == 3 and after.metrics()["spot/added_seconds"] > 0

    # warm start: a new spot trainer takes a saved train state's AdamW moments (not its params or step)
    ckpt = Checkpointer(tmp_path / TRAIN_STATE_DIR, async_save=False)
    ckpt.save(3, after.state)
    ckpt.close()
    fresh = SpotTrainer(SpotConfig(mode="after_rollout", **SPOT), Drafter(model.cfg, nnx.Rngs(2)), eng)
    params = leaves(fresh.params)
    assert not fresh.warm_start(tmp_path / "missing")
    assert fresh.warm_start(tmp_path / TRAIN_STATE_DIR)
    for a, b in zip(leaves(fresh.state.opt_state), leaves(after.state.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(x).max() > 0 for x in leaves(fresh.state.opt_state))
    for a, b in zip(leaves(fresh.params), params, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.state.step) == 0


def test_spot_config_and_mesh_errors(model):
    with pytest.raises(ValueError, match="config.spot.mode='sometimes'"):
        SpotConfig(mode="sometimes")
    long_window = SpotConfig(mode="between_chunks", **{**SPOT, "window": 1024})  # the engine records 512
    with pytest.raises(ValueError, match="config.spot.window=1024 exceeds config.rollout.hidden_window=512"):
        SpotTrainer(long_window, Drafter(model.cfg, nnx.Rngs(1)), engine(model, 1))
    with pytest.raises(ValueError, match="idle_devices needs a data axis of >= 2 devices"):
        SpotTrainer(
            SpotConfig(mode="idle_devices", **SPOT), Drafter(model.cfg, nnx.Rngs(1)), engine(model, 1)
        )


def test_staleness_probe_ranks_equal_top_k(random_samples):
    """The staleness probe counts by the target token's rank (no vocabulary sort); its hits equal a
    `lax.top_k` reference over the full head and over a reduced draft vocabulary (where a token outside the
    vocabulary is a miss). The head is scaled down so the target token often ranks in the top 3."""
    cfg = tiny_config("llama")
    target = Transformer(cfg, nnx.Rngs(0))
    drafter = Drafter(cfg, nnx.Rngs(3))
    samples = random_samples(target, [20, 24, 30, 17], [4, 5, 3, 6], seed=2)
    batch = to_device(pack_samples(samples, 32, 4)[0])
    graphdef, params = nnx.split(drafter, nnx.Param)
    embed = target.embed[...]
    head = target.head_weight() * 0.05  # a flat-ish head: the target token is often in the top 3
    rng = np.random.default_rng(0)
    vocab = jnp.asarray(np.sort(rng.choice(cfg.vocab_size, cfg.vocab_size // 2, replace=False)), jnp.int32)

    @jax.jit  # one program, not one per operation
    def reference_sums(head_w, vocab):
        e = eagle_inputs(batch)
        h, _ = nnx.merge(graphdef, params)(embed[e.next_tokens], e.hidden_in, e.positions, None, e.mask)
        top = jax.lax.top_k(h @ head_w.T, 3)[1]
        top = top if vocab is None else vocab[top]
        nxt, ok = shift_left(e.next_tokens, -1), e.valid & shift_left(e.valid, False)
        hit1 = (top[..., 0] == nxt) & ok
        hit3 = jnp.any(top == nxt[..., None], axis=-1) & ok
        return {"top1": hit1.sum(), "top3": hit3.sum(), "count": ok.sum()}

    def reference(head_w, vocab):
        return {k: int(x) for k, x in reference_sums(head_w, vocab).items()}

    for head_w, v in ((head, None), (jnp.take(head, vocab, axis=0), vocab)):
        hits = jax.jit(topk_hits, static_argnums=0)(graphdef, params, batch, embed, head_w, v)
        got = {k: int(x) for k, x in hits.items()}
        want = reference(head_w, v)
        assert got == want and want["top3"] > 0 and want["top3"] > want["top1"], (got, want)
