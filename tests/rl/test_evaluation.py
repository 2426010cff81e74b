"""Evaluation: the held-out split (the same problems and keys every time, paired; logged at step 0 and every k
steps; never trained on, in any epoch); benchmark sets decoded by the rollout engine with speculation (in
float32 with coupled acceptance the very tokens of plain decoding, the selector played and never taught);
mean@k, pass@k, maj@k and best@k against hand-computed values (and every subset counted by brute force);
the `evals=` shorthand and config keys; a clear error for a bad eval section."""

from __future__ import annotations

import itertools
import json
import pathlib
import random

import jax
import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.config_sections import EvalConfig
from tlt_jax.models.config import tiny_config
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rl import config as rl_config
from tlt_jax.rl.eval_decoding import EvalDecoding, exploit_arm
from tlt_jax.rl.eval_metrics import best_at_k, maj_at_k, pass_at_k, sample_metrics, vote_key
from tlt_jax.rl.evaluation import SetEval, _eval_set, eval_sampling, eval_set_configs
from tlt_jax.rl.learner import Learner
from tlt_jax.rollout import beg_mab
from tlt_jax.rollout.adaptive import build_policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.selector_config import MAX_RUNNING, BanditSection, SelectorConfig
from tlt_jax.rollout.strategy import SpecConfig
from tlt_jax.tasks import make_task
from tlt_jax.tasks.base import TrainSplit

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TIMING = ("seconds", "decode_seconds", "tok_per_s", "compile_seconds")  # wall-clock metrics: not paired


def eval_config(steps: int = 2, every: int = 2, size: int = 32):
    c = config_lib.load_config_file(CONFIGS / "smoke.py", f"steps={steps}")
    c.task.size = size
    c.eval.every, c.eval.prompts, c.eval.samples = every, 2, 8  # 16 rows: the training step's programs
    return c


def test_eval_is_paired_logged_at_step_zero_and_every_k(tmp_path) -> None:
    learner = Learner(eval_config(steps=3, every=2), str(tmp_path))
    try:
        first, again = learner.evaluator.run(), learner.evaluator.run()
        assert learner.train() == "done"
    finally:
        learner.close()
    # unchanged policy, same keys: the same samples, so the same scores (no noise between evaluations)
    for k in first:
        if not k.endswith(TIMING):
            assert first[k] == again[k], k
    assert first["eval/sd_share"] == 0.0 and "eval/accept_len" not in first  # no drafter: plain decoding
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    with_eval = [r["step"] for r in rows if "eval/reward" in r]
    assert with_eval == [0, 2, 3]  # before training, every 2 steps, and after the last
    assert rows[0]["eval/reward"] == first["eval/reward"]
    # 2 prompts x 8 samples: the accuracy is a count of 16 responses (a mean over anything else is not)
    assert (rows[-1]["eval/accuracy"] * 16) == pytest.approx(round(rows[-1]["eval/accuracy"] * 16), abs=1e-6)
    assert rows[-1]["eval/length_mean"] > 0


def test_before_train_and_every() -> None:
    """config.eval.before_train (VeRL's trainer.val_before_train) and every (trainer.test_freq)."""
    on, off = EvalConfig(every=2), EvalConfig(every=2, before_train=False)
    assert [s for s in range(6) if on.due(s, 5)] == [0, 2, 4, 5]
    assert [s for s in range(6) if off.due(s, 5)] == [2, 4, 5]
    assert not any(EvalConfig(every=0).due(s, 5) for s in range(6))


def test_held_out_problems_are_never_trained_on_in_any_epoch() -> None:
    c = eval_config(steps=4, size=8)  # 4 steps x 2 prompts read 8 positions of the 6 training problems
    task = make_task(c.task)
    split = TrainSplit(task, 2)
    held_out = {task.problem(int(i)).uid for i in split.held_out_indices}
    assert held_out == {p.uid for p in task.batch(len(task) - 2, 2)[0]}  # the first epoch's last two
    first, _ = split.batch(0, 6)
    assert [p.uid for p in first] == [p.uid for p in task.batch(0, 6)[0]]  # epoch 0: the order as before
    later, _ = split.batch(6, 18)  # epochs 1-3: each a reshuffle of the same six
    assert not held_out & {p.uid for p in first + later}
    assert [sorted(p.uid for p in later[i : i + 6]) for i in (0, 6, 12)] == [sorted(p.uid for p in first)] * 3
    assert [p.uid for p in later[:6]] != [p.uid for p in later[6:12]]
    with pytest.raises(ValueError, match=r"config.eval.prompts=8: .*0 < prompts < the task's 8"):
        TrainSplit(task, 8)


# ---- estimators -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,c,k,want",
    [(4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 3, 1.0), (5, 2, 2, 0.7), (8, 3, 4, 1 - 5 / 70)],
)
def test_pass_at_k_unbiased_estimator(n: int, c: int, k: int, want: float) -> None:
    # 1 - C(n-c, k) / C(n, k) by hand: (4,1,2): 1 - 3/6; (5,2,2): 1 - 3/10; (8,3,4): 1 - C(5,4)/C(8,4)
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_best_at_k_by_hand() -> None:
    # rewards (0, 0.5, 1, 1): of the 6 pairs, 5 hold a 1 and (0, 0.5) has max 0.5 -> (5 + 0.5) / 6
    assert best_at_k([1, 0, 1, 0.5], 2) == pytest.approx(5.5 / 6)
    assert best_at_k([1, 0, 1, 0.5], 1) == pytest.approx(0.625)  # the mean
    assert best_at_k([1, 0, 1, 0.5], 4) == 1.0  # the max
    # DAPO's -1/+1 scale: triples of (-1, -1, -1, 1): 1 of the 4 triples has no +1 -> (3 - 1) / 4
    assert best_at_k([-1, 1, -1, -1], 3) == pytest.approx(0.5)
    # 0/1 rewards: best@k is pass@k
    assert best_at_k([1, 0, 0, 1, 0], 2) == pytest.approx(pass_at_k(5, 2, 2))


def test_maj_at_k_by_hand() -> None:
    v, ok = ["7", "3", "7", None], [True, False, True, False]  # "7" is right, "3" wrong, one abstains
    assert maj_at_k(v, ok, 4) == 1.0  # 7 has 2 votes of 3
    # pairs: (7,3) tie -> 7 (first to appear); (7,7); (7,3); (7,None); (3,7) tie -> 7; (3,None) -> 3;
    # (7,None) -> 7: 5 of 6 pairs elect 7
    assert maj_at_k(v, ok, 2) == pytest.approx(5 / 6)
    assert maj_at_k(v, ok, 1) == pytest.approx(0.5)  # a single sample: its own verdict (None: wrong)
    # a tie at k: the answer that appeared first wins ("3" here, wrong)
    assert maj_at_k(["3", "7", "7", "3"], [False, True, True, False], 4) == 0.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nobody voted
    # an answer's verdict is its first sample's (a checker that judged the same answer twice differently)
    assert maj_at_k(["5", "5", "2"], [True, False, False], 3) == 1.0


def brute_force_maj(votes: list, correct: list, k: int) -> float:
    """Every k-subset voted on: the answer with most votes, ties to the first to appear in all k samples."""
    first = {v: i for i, v in reversed(list(enumerate(votes))) if v is not None}
    wins = 0
    subsets = list(itertools.combinations(range(len(votes)), k))
    for sub in subsets:
        counts: dict = {}
        for i in sub:
            if votes[i] is not None:
                counts[votes[i]] = counts.get(votes[i], 0) + 1
        if counts:
            top = max(counts.values())
            winner = min((first[a], a) for a, c in counts.items() if c == top)[1]
            wins += bool(correct[first[winner]])
    return wins / len(subsets)


def test_maj_and_best_at_k_equal_every_subset_counted() -> None:
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 8)
        votes = [rng.choice(["a", "b", "c", None]) for _ in range(n)]
        correct = [rng.random() < 0.4 for _ in range(n)]
        rewards = [rng.choice([-1.0, 0.0, 0.5, 1.0]) for _ in range(n)]
        for k in range(1, n + 1):
            assert maj_at_k(votes, correct, k) == pytest.approx(brute_force_maj(votes, correct, k), abs=1e-12)
            best = np.mean([max(rewards[i] for i in s) for s in itertools.combinations(range(n), k)])
            assert best_at_k(rewards, k) == pytest.approx(best, abs=1e-12)


def test_sample_metrics() -> None:
    correct = np.asarray([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    rewards = correct + 0.5 * np.asarray([[0, 1, 0, 0], [0] * 4, [0] * 4])  # a format bonus on one sample
    votes = [["7", "5", "5", None], ["1"] * 4, [None] * 4]
    m = sample_metrics(
        correct, rewards, votes, np.asarray([10] * 11 + [22]), np.asarray([False] * 11 + [True])
    )
    # problem 0: "5" (wrong) has 2 votes of 3 -> maj@4 0; pairs: 6 pairs, (7,5) x2 tie -> 7, (7,None) -> 7:
    # maj@2 = 3/6; best@2: max over pairs of (1, .5, 0, 0): 3 pairs hold the 1, (.5,0) x2 -> .5: 4/6
    assert m == pytest.approx(
        {
            "mean@4": 5 / 12,
            "reward_mean": 5.5 / 12,
            "pass@1": (0.25 + 1 + 0) / 3,
            "pass@2": (0.5 + 1 + 0) / 3,
            "pass@4": 2 / 3,
            "maj@1": (0.25 + 1 + 0) / 3,
            "maj@2": (0.5 + 1 + 0) / 3,
            "maj@4": (0 + 1 + 0) / 3,
            "best@1": (1.5 / 4 + 1 + 0) / 3,
            "best@2": (4 / 6 + 1 + 0) / 3,
            "best@4": (1 + 1 + 0) / 3,
            "length_mean": 11.0,
            "clip_frac": 1 / 12,
        }
    )
    assert vote_key(" \\frac{1}{2} ") == vote_key("0.5") == "0.5" and vote_key("Paris.") == "paris"
    assert vote_key("") is None and vote_key(None) is None
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


# ---- what evaluation decodes with ------------------------------------------------------------------------


def selector_cfg(algorithm: str, **kw) -> SelectorConfig:
    return SelectorConfig(
        arms=("plain", "3_1_4", "2_1_3"), tokens_to_verify=(1, 4, 3), bucket_bounds=(4, MAX_RUNNING),
        algorithm=algorithm, window=8, min_plays=3, **kw,
    )  # fmt: skip


def taught(cfg: SelectorConfig, plays: list[tuple[str, int, float]]):
    state = beg_mab.init(cfg)
    for arm, running, reward in plays:
        state = beg_mab.update(cfg, state, running, cfg.arm_index(arm), reward, 2.0)
    return jax.device_get(state)


def test_exploit_arm_plays_what_the_selector_learned_or_defers() -> None:
    cfg = selector_cfg("beg_mab", eligible=((True,) * 3,) * 2)
    assert exploit_arm(cfg, jax.device_get(beg_mab.init(cfg)), 2) is None  # nothing learned: no opinion
    # bucket 0: 3_1_4 rewards 9, 1, 8 (median 8, mean 6) against plain's 7, 7, 7; 2_1_3 played twice only
    plays = [("plain", 2, 7.0)] * 3 + [("3_1_4", 2, r) for r in (9.0, 1.0, 8.0)] + [("2_1_3", 2, 50.0)] * 2
    state = taught(cfg, plays)
    assert exploit_arm(cfg, state, 2) == "3_1_4"  # median 8 > 7; 2_1_3 untrusted (2 < min_plays)
    assert exploit_arm(cfg, state, 9) is None  # bucket 1 never played
    egreedy = selector_cfg("egreedy")
    assert exploit_arm(egreedy, taught(egreedy, plays), 2) == "2_1_3"  # mean, one reward is enough
    no_outlier = [p for p in plays if p[0] != "2_1_3"]
    assert exploit_arm(egreedy, taught(egreedy, no_outlier), 2) == "plain"  # mean 7 > 6
    # beg_mab forgets by the bucket's last `window` (8) plays: 9 plain plays later the others are stale
    stale = taught(cfg, plays + [("plain", 2, 1.0)] * 9)
    assert exploit_arm(cfg, stale, 2) == "plain"
    fixed = selector_cfg("fixed", fixed_table=("2_1_3", "plain"))
    assert [exploit_arm(fixed, jax.device_get(beg_mab.init(fixed)), r) for r in (1, 5)] == ["2_1_3", "plain"]
    sglang = selector_cfg("sglang", sglang_ladder=("plain", "2_1_3", "3_1_4"), sglang_start=1)
    assert exploit_arm(sglang, jax.device_get(beg_mab.init(sglang)), 3) == "2_1_3"


def peaked_target(mirror):
    """A float32 mirror target of 2 layers over the byte vocabulary, its head scaled up so that the next token
    is peaked (drafts are accepted)."""
    target = mirror.target(tiny_config(vocab_size=264, num_layers=2, tie_embeddings=False))
    target.lm_head[...] = target.lm_head[...] * 30.0
    return target


def sd_eval_engine(target, **drafter_kw) -> RolloutEngine:
    """The eval's engine: SD (3_1_4 chains, coupled acceptance) on for the whole rollout, 24 new tokens, the
    byte tokenizer's EOS; `drafter_kw`: the EAGLE drafter (and its draft_vocab)."""
    spec = SpecConfig(enabled=True, drafter="eagle", strategy="3_1_4", threshold=1024, min_steps_below=0)
    config = EngineConfig(
        max_new_tokens=24, max_cache_len=128, chunk_steps=4, min_cache_bucket=128, compact=False, spec=spec
    )
    return RolloutEngine(target, config, eos_ids=ByteTokenizer().eos_token_ids, **drafter_kw)


def toy_eval_sets(folder) -> list:
    """One benchmark set of 2 problems x 4 samples at T 0.7, top-p 0.95 (the rollout's T 1.0 overridden)."""
    bench = folder / "bench.jsonl"
    bench.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in ("Say 1.", "Count.")))
    cfg = EvalConfig(every=1, samples=4, temperature=0.7, top_p=0.95)
    specs = eval_set_configs({"toy": {"path": str(bench), "prompt": "none"}}, {})
    return [_eval_set(name, t, s, cfg, SamplingParams(temperature=1.0)) for name, (t, s) in specs.items()]


@pytest.fixture(scope="module")
def sd_eval(mirror, tmp_path_factory):
    """A float32 mirror target (its next token depends on the context, its head scaled up so that it is
    peaked) with a near-copy EAGLE drafter (3_1_4 chains accept ~1.45 tokens per round at T 0.7), a
    byte tokenizer, SD on for the whole rollout with coupled acceptance (the threshold switch at 1024 rows),
    and a benchmark set of 2 problems x 4 samples at T 0.7, top-p 0.95 (8 rows: one batch)."""
    target = peaked_target(mirror)
    tokenizer = ByteTokenizer()
    engine = sd_eval_engine(target, drafter=mirror.drafter(target, noise=0.03))
    sets = toy_eval_sets(tmp_path_factory.mktemp("bench"))
    assert sets[0].sampling == SamplingParams(temperature=0.7, top_p=0.95) and sets[0].samples == 4

    def run(selector=None) -> dict[str, float]:
        decoding = EvalDecoding(engine, lambda: (None, None), selector, plain_baseline=True)
        return SetEval(sets, tokenizer, decoding, jax.random.key(3), rows=16).run()

    return engine, run


def test_eval_with_speculation_decodes_plain_decodings_tokens(sd_eval) -> None:
    """float32, coupled acceptance: the eval's speculative rollout and its paired plain pass (same keys) emit
    identical responses, while drafts are accepted (the identity would be trivial if they were not)."""
    _, run = sd_eval
    m = run()
    assert m["eval/toy/plain_match"] == 1.0
    assert m["eval/toy/sd_share"] == 1.0 and m["eval/toy/accept_len"] > 1.3, m
    assert m["eval/toy/sd_speedup"] > 0 and m["eval/toy/plain_seconds"] > 0
    assert {"maj@4", "best@4", "pass@4", "mean@4"} <= {k.split("/")[-1] for k in m}


def test_eval_plays_the_selectors_choices_and_teaches_it_nothing(sd_eval) -> None:
    """With a selector the evaluation plays its current best arm per running-row bucket (here plain over the
    threshold switch's SD, then an SD arm) and leaves its state and PRNG key bit for bit as they were."""
    engine, run = sd_eval
    section = BanditSection(algorithm="beg_mab", arms=("plain", "3_1_4"), bucket_bounds=(4,), window=8)
    selector = build_policy(section, engine, seed=0)
    for arm, reward in (("plain", 9.0), ("3_1_4", 5.0)):
        for running in (2, 8):
            for _ in range(3):
                selector.policy.observe(arm, running, reward, 2.0)
    before = jax.device_get(selector.policy.state_dict())
    m = run(selector)
    assert m["eval/toy/sd_share"] == 0.0 and m["eval/toy/plain_match"] == 1.0  # plain leads: plain played
    after = jax.device_get(selector.policy.state_dict())
    jax.tree.map(np.testing.assert_array_equal, before["state"], after["state"])
    np.testing.assert_array_equal(jax.random.key_data(before["key"]), jax.random.key_data(after["key"]))
    for running in (2, 8):  # now the SD arm leads everywhere
        for _ in range(6):
            selector.policy.observe("3_1_4", running, 20.0, 2.0)
    m = run(selector)
    assert m["eval/toy/sd_share"] == 1.0 and m["eval/toy/plain_match"] == 1.0


# ---- config ----------------------------------------------------------------------------------------------


def test_evals_shorthand_and_config_keys() -> None:
    spec = "aime@/d/aime.parquet@samples=32@temperature=1.0@top_p=0.7@reward=dapo+m@/m.jsonl"
    sets = config_lib.eval_sets(spec)
    assert sets == {
        "aime": {
            "path": "/d/aime.parquet",
            "samples": 32,
            "temperature": 1.0,
            "top_p": 0.7,
            "reward": "dapo",
        },
        "m": {"path": "/m.jsonl"},
    }
    for bad in ("aime", "aime@", "aime@/p@samples", "aime@/p@samples=many"):
        with pytest.raises(ValueError, match="evals"):
            config_lib.eval_sets(bad)
    # a set's own key, else config.eval's (VeRL's val_kwargs), else the rollout's
    specs = eval_set_configs(sets, {})
    cfg = EvalConfig(samples=8, temperature=0.6, top_k=20)
    rollout = SamplingParams(temperature=0.9, top_p=0.8)
    aime = _eval_set_sampling(specs["aime"][1], cfg, rollout)
    assert aime == (32, SamplingParams(temperature=1.0, top_k=20, top_p=0.7))
    assert _eval_set_sampling(specs["m"][1], cfg, rollout) == (8, SamplingParams(0.6, top_k=20, top_p=0.8))
    c = eval_config()
    c.eval.temperature, c.eval.top_p = 1, 0.7  # typed placeholders: the command line can set them
    assert rl_config.validate_grpo(c).eval.temperature == 1.0


def _eval_set_sampling(own: dict, cfg: EvalConfig, rollout: SamplingParams) -> tuple[int, SamplingParams]:
    return int(own.get("samples", cfg.samples)), eval_sampling(cfg, rollout, own)


@pytest.mark.parametrize(
    "bad",
    [
        dict(every=-1),
        dict(prompts=-1),
        dict(samples=0),
        dict(temperature=-1.0),
        dict(top_p=1.5),
        dict(evry=1),
        dict(sets={"x": {"samples": 2}}),
        dict(sets={"x": {"path": "/nonexistent/x.parquet"}}),
    ],
)
def test_bad_eval_section_names_the_field(bad) -> None:
    c = eval_config()
    for k, v in bad.items():
        c.eval[k] = v
    with pytest.raises(ValueError, match="config.eval"):
        rl_config.validate_grpo(c)


def test_eval_sets_and_seconds_outside_the_step_time(tmp_path) -> None:
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"question": f"Say {d}.", "answer": d}) + "\n" for d in "12"))
    c = eval_config(steps=1, every=1)
    # 2 x 8 rows as a training step (its programs serve), short prompts for the byte tokenizer
    toy = {"path": str(bench), "samples": 8, "max_new_tokens": 8, "prompt": "none"}
    # a reward function of ours giving partial credit: VeRL's acc is the number, so mean@k is 0.25 (a mean@k
    # over the verdict, score >= 1, would be 0)
    partial = tmp_path / "partial_reward.py"
    partial.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.25\n"
    )
    c.eval.sets = {
        "toy": toy,
        "partial": {**toy, "reward": f"{partial}:score"},
        "greedy": {"path": str(bench), "samples": 8, "temperature": 0.0, "prompt": "none"},
    }
    learner = Learner(c, str(tmp_path / "w"))
    try:
        learner.train()
    finally:
        learner.close()
    rows = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert set(rows[0]) == {"step"} | {k for k in rows[1] if k.startswith("eval/")}
    assert np.isfinite(rows[1]["time/step"]) and rows[1]["eval/seconds"] > 0
    toy = {k.removeprefix("eval/toy/") for k in rows[1] if k.startswith("eval/toy/")}
    estimators = {f"{e}@{j}" for e in ("pass", "maj", "best") for j in (1, 2, 4, 8)}
    speed = {"decode_seconds", "sd_share", "tok_per_s", "compile_seconds"}
    assert toy == {"mean@8", "reward_mean", "length_mean", "clip_frac", "seconds"} | estimators | speed
    assert rows[1]["eval/toy/length_mean"] <= 8
    passes = [rows[1][f"eval/toy/pass@{j}"] for j in (1, 2, 4, 8)]  # more draws never pass less often
    assert passes == sorted(passes) and passes[0] == pytest.approx(rows[1]["eval/toy/mean@8"]), rows[1]
    assert (
        rows[1]["eval/partial/mean@8"] == pytest.approx(0.25) and rows[1]["eval/partial/reward_mean"] == 0.25
    )
    greedy = {k: rows[1][f"eval/greedy/{k}"] for k in ("mean@8", "pass@1", "pass@8", "maj@8", "maj@1")}
    assert len(set(greedy.values())) == 1  # 8 identical greedy samples: every estimate is the accuracy
