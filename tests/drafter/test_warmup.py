"""Acceptance evaluation vs a brute-force chain drafter, and the warm-up job end to end (tiny config)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import config_schema
from tlt_jax.config_lib import load_config_file
from tlt_jax.drafter import evaluate as ev
from tlt_jax.drafter import packing, warmup, warmup_data
from tlt_jax.drafter.loss import LossConfig
from tlt_jax.drafter.trainer import DrafterTrainer, optimizer_from_config
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.models.llama import Transformer
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer
from tlt_jax.utils.tracking import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
CFG = tiny_config(vocab_size=6)  # a small vocabulary: random drafts often match, so runs of all lengths occur


def load_config(arg=None):
    return load_config_file(ROOT / "configs" / "drafter_warmup.py", arg)


PAD = 32


@nnx.jit
def _drafter_fwd(drafter, emb, hid, pos):
    return drafter(emb, hid, pos)[0]  # cache=None, default causal mask


def brute_force_accepted(drafter, target, sample, depth):
    """Per position: draft a chain by re-running the Drafter module on [true pairs 0..t] + the chain so far
    (plain causal mask), compare with the target's argmax given the true prefix, count leading matches."""
    emb, head = np.asarray(target.embed[...]), np.asarray(target.head_weight())
    toks, hid = sample.tokens, np.asarray(sample.hidden, np.float32)
    greedy = np.argmax(hid @ head.T, axis=-1)
    n = len(toks)
    out = []
    for t in range(n):
        if not (t + depth + 1 <= n - 1 and sample.loss_mask[t + 1]):
            continue
        in_tok = [int(toks[s + 1]) for s in range(t + 1)]
        in_h = [hid[s] for s in range(t + 1)]
        pos = [s + 1 for s in range(t + 1)]
        accepted, alive = 0, True
        for j in range(1, depth + 1):
            m = len(in_tok)  # padded to a fixed length for one compile; causal: the padding is never seen
            x_e = np.zeros((PAD, emb.shape[1]), np.float32)
            x_h = np.zeros((PAD, emb.shape[1]), np.float32)
            x_p = np.zeros((PAD,), np.int32)
            x_e[:m], x_h[:m], x_p[:m] = emb[in_tok], np.stack(in_h), pos
            h_new = np.asarray(_drafter_fwd(drafter, x_e[None], x_h[None], x_p[None]))[0, m - 1]
            d = int(np.argmax(h_new @ head.T))
            alive = alive and d == greedy[t + j]
            accepted += int(alive)
            in_tok.append(d)
            in_h.append(h_new)
            pos.append(t + 1 + j)
        out.append(accepted)
    return out


def test_acceptance_matches_brute_force(three_samples):
    target, samples = three_samples(CFG, seed=0)
    drafter = Drafter(CFG, nnx.Rngs(5))
    depth = 3
    want = [a for s in samples for a in brute_force_accepted(drafter, target, s, depth)]
    assert len(set(want)) >= 2, want  # the comparison covers different run lengths

    emb, head = target.embed[...], target.head_weight()
    graphdef, params = nnx.split(drafter, nnx.Param)
    # 2 rows of 32: several samples share a row (segment isolation is part of what is checked)
    res = ev.AcceptanceEvaluator(graphdef, depth, seq_len=32, rows=2)(params, samples, emb, head)
    assert res.num_positions == len(want)
    np.testing.assert_allclose(res.mean_accepted, np.mean(want), rtol=1e-6)
    assert res.accept_length == pytest.approx(np.mean(want) + 1)
    np.testing.assert_allclose(res.per_position, [np.mean(np.asarray(want) >= j) for j in (1, 2, 3)])
    assert res.histogram == [want.count(k) for k in range(depth + 1)]
    # random tokens are not the target's greedy choices
    assert res.target_greedy_match < 0.9
    # drafting at every position (no per-row gather) gives the same counts
    batches = list(packing.iterate_packed(samples, 32, 2))
    full = jax.jit(ev.acceptance_counts, static_argnums=(4, 5))
    tot = [jax.device_get(full(drafter, packing.to_device(b), emb, head, depth, None)) for b in batches]
    assert sum(int(t["num_positions"]) for t in tot) == len(want)
    assert sum(int(t["accepted"]) for t in tot) == sum(want)


def test_shared_prompt_forward_equals_separate_forwards():
    cfg = tiny_config(vocab_size=32)
    target = Transformer(cfg, nnx.Rngs(1))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 32, size=n).tolist() for n in (5, 7)]
    responses = [
        [rng.integers(0, 32, size=n).tolist() for n in (4, 9, 1)],
        [rng.integers(0, 32, size=12).tolist()],
    ]
    # seq_len 16: the first prompt's three responses need two segments; the second pair is truncated to 16
    got = warmup_data.target_hidden_states(
        warmup_data.make_hidden_fn(target), prompts, responses, rows=2, seq_len=16
    )
    fwd = nnx.jit(lambda m, x: m(x, jnp.arange(x.shape[1])[None], compute_logits=False).hidden)
    for g, p in enumerate(prompts):
        for k, r in enumerate(responses[g]):
            seq = (p + r)[:16]
            want = np.asarray(fwd(target, jnp.asarray(seq)[None]))[0]
            assert got[g][k].shape == want.shape
            np.testing.assert_allclose(got[g][k], want, rtol=1e-5, atol=1e-5)


def test_recorded_features_equal_the_forward_path(tmp_path):
    """generation.record_hidden (the default): the features the engine records while generating equal the
    packed target forward's over the same sequences; a sample is prompt + response[:-1] (the newest token
    was never fed), so it has one pair fewer than the forward path's."""
    from tlt_jax.tasks import make_task

    config = load_config("tiny")
    target, tokenizer = warmup.build_target(config_schema.parse(config))
    task = make_task(config.task)
    got = {}
    for record in (True, False):
        config.generation.record_hidden = record
        job = config_schema.parse(config)
        (tmp_path / f"data_{record}").mkdir()
        got[record], _ = warmup_data.build_split(
            "train",
            job=job,
            task=task,
            tokenizer=tokenizer,
            engine=warmup_data.warmup_engine(job, target, tokenizer),
            hidden_fn=warmup_data.make_hidden_fn(target),
            start=0,
            num_prompts=3,
            n=2,
            temperature=1.0,
            data_dir=tmp_path / f"data_{record}",
            times=warmup_data.PhaseTimes(tmp_path / f"times_{record}.json"),
        )
    assert len(got[True]) == len(got[False]) == 6
    for rec, fwd in zip(got[True], got[False], strict=True):
        assert rec.length == fwd.length - 1 and rec.length > int(np.argmax(rec.loss_mask))
        np.testing.assert_array_equal(rec.tokens, fwd.tokens[:-1])
        np.testing.assert_array_equal(rec.loss_mask, fwd.loss_mask[:-1])
        np.testing.assert_allclose(
            rec.hidden.astype(np.float32), fwd.hidden[:-1].astype(np.float32), rtol=2e-3, atol=2e-3
        )


@pytest.mark.slow
def test_warmup_end_to_end_and_resume(tmp_path):
    config = load_config("tiny")
    wd = tmp_path / "wd"
    assert warmup.run_warmup(config_schema.parse(config), wd) == "done"

    result = json.loads((wd / warmup.RESULT_FILE).read_text())
    assert result["complete"]
    for k in ("before", "after"):
        assert result[k]["depth"] == 3 and result[k]["num_positions"] > 0
        assert len(result[k]["per_position"]) == 3
    assert result["data"]["train_sequences"] == 8 and result["data"]["eval_sequences"] == 4
    vocab = np.load(wd / "drafter" / "draft_vocab.npy")  # the tiny vocabulary is smaller than 8192: all of it
    assert result["draft_vocab"] and vocab.tolist() == list(range(config.model.random.vocab_size))
    assert {"load_target", "generate_train", "forward_train", "eval_before", "train", "eval_after"} <= set(
        result["phase_seconds"]
    )
    assert sorted(p.name for p in (wd / "data").iterdir()) == [
        "eval_000.npz",
        "train_000.npz",
        "train_001.npz",
    ]
    rows = read_metrics(wd / "metrics.jsonl")
    train_steps = [r["step"] for r in rows if "train/loss" in r]
    assert train_steps == [2, 4, 6]
    assert all(np.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    assert [r["step"] for r in rows if "eval/accept_length" in r] == [0, 6]

    # load_drafter restores the trained weights (equal to the final train state, different from a fresh init)
    target_cfg = ModelConfig(**dict(config.model.random), dtype=config.model.dtype)
    loaded = warmup.load_drafter(wd, target_cfg)
    got = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    trainer = DrafterTrainer(optimizer_from_config(config.train)[0], LossConfig(), seed=config.seed)
    fresh = trainer.init_state(Drafter(target_cfg, nnx.Rngs(params=config.seed)))
    ckpt = Checkpointer(wd / warmup.TRAIN_STATE_DIR)
    final = trainer.restore(ckpt)
    ckpt.close()
    assert int(final.step) == 6
    want = nnx.to_pure_dict(final.params)
    init = nnx.to_pure_dict(fresh.params)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(init), strict=True)
    )
    assert loaded.cfg.num_layers == 1
    # the stored checkpoint holds the drafter's own weights only: fc and its one layer, no target-sized
    # embedding or LM head [V, H] and no optimizer state
    dckpt = DrafterCheckpointer(wd / warmup.DRAFTER_DIR, async_save=False)
    stored = dckpt.restore()
    dckpt.close()
    assert set(stored) == {"fc", "layer"}
    n_stored = sum(np.asarray(x).size for x in jax.tree.leaves(stored))
    assert n_stored == sum(x.size for x in jax.tree.leaves(got))
    assert all(config.model.random.vocab_size not in np.shape(x) for x in jax.tree.leaves(stored))

    # a rerun of a finished workdir does nothing; after losing the final outputs it resumes: cached data,
    # no new training steps, the same trained drafter
    gen_time = json.loads((wd / warmup.PHASE_TIMES_FILE).read_text())["generate_train"]
    assert warmup.run_warmup(config_schema.parse(config), wd) == "done"
    (wd / warmup.RESULT_FILE).unlink()
    assert warmup.run_warmup(config_schema.parse(config), wd) == "done"
    times = json.loads((wd / warmup.PHASE_TIMES_FILE).read_text())
    assert times["generate_train"] == gen_time
    again = json.loads((wd / warmup.RESULT_FILE).read_text())
    assert again["after"] == result["after"] and again["before"] == result["before"]
    rows2 = read_metrics(wd / "metrics.jsonl")
    assert [r["step"] for r in rows2 if "train/loss" in r] == [2, 4, 6]

    # the generic entry point dispatches to the warm-up (finished workdir: returns at once)
    from tlt_jax import main

    assert main.run(config, str(wd)) == "done"
    assert read_metrics(wd / "metrics.jsonl") == rows2

    # a longer schedule for the finished workdir trains on from step 6 (no new data) and saves step 8
    config.train.steps = 8
    assert warmup.run_warmup(config_schema.parse(config), wd) == "done"
    longer = json.loads((wd / warmup.RESULT_FILE).read_text())
    assert longer["complete"] and longer["drafter_checkpoint"]["step"] == 8
    rows3 = read_metrics(wd / "metrics.jsonl")
    assert [r["step"] for r in rows3 if "train/loss" in r] == [2, 4, 6, 8]
    assert json.loads((wd / warmup.PHASE_TIMES_FILE).read_text())["generate_train"] == gen_time


def test_config_args():
    """`:long` is the default SmolLM2 warm-up with more data and steps, nothing else; unknown args fail."""
    default, long = load_config(), load_config("long")
    assert (long.generation.num_prompts, long.train.steps) == (768, 3600)
    long.generation.num_prompts, long.train.steps = default.generation.num_prompts, default.train.steps
    assert long.to_dict() == default.to_dict()
    with pytest.raises(ValueError, match="unknown config arg 'longer'"):
        load_config("longer")
