"""configs/recipes/: VeRL's DAPO recipe as a config (its hyper-parameters, at both scales, validated with the
paths a cluster user passes), and `configs/tlt.py:dapo`, the same algorithm at this CPU's size. The recipe's
runlocal run is one of tests/documented_jobs.py's jobs."""

from __future__ import annotations

import pathlib

import pytest

from tlt_jax import config_lib
from tlt_jax.rl.config import validate_grpo

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "recipes" / "dapo_qwen2_5_7b.py"


@pytest.mark.parametrize("scale, prompts, gen, minis", [("node", 64, 192, 2), ("verl", 512, 1536, 16)])
def test_dapo_recipe_has_verls_hyper_parameters(tmp_path, scale, prompts, gen, minis) -> None:
    c = config_lib.load_config_file(RECIPE, f"scale={scale},evals=aime24@{tmp_path / 'aime.parquet'}")
    c.model.path, c.task.path = str(tmp_path / "Qwen2.5-7B"), str(tmp_path / "dapo.parquet")
    job = validate_grpo(c, check_paths=False)
    rl, ro, ev = job.rl, job.rollout, job.eval
    assert (rl.prompts_per_step, rl.gen_prompts_per_batch, rl.mini_batches) == (prompts, gen, minis)
    assert (rl.samples_per_prompt, ro.temperature, ro.top_p) == (16, 1.0, 1.0)
    assert (rl.clip_low, rl.clip_high, rl.clip_ratio_c, rl.loss_agg) == (0.2, 0.28, 10.0, "token_mean")
    assert (rl.kl_coef, rl.reward_kl_coef, rl.entropy_coeff, rl.adv_std) == (0.0, 0.0, 0.0, "unbiased")
    assert (rl.dynamic_sampling, rl.filter_metric, rl.max_num_gen_batches) == (True, "acc", 10)
    assert (rl.overlong_buffer, rl.overlong_penalty, ro.max_new_tokens) == (4096, 1.0, 20480)
    assert ro.max_cache_len - ro.max_new_tokens == 2048  # VeRL's max_prompt_length
    assert (rl.lr, rl.weight_decay, rl.grad_clip, rl.warmup_steps) == (1e-6, 0.1, 1.0, 10 * minis)
    assert (job.task["reward"], job.task["reward_scale"], job.task["kind"]) == ("verl", "verl", "parquet")
    # one sample per row: DAPO's AIME file repeats each problem 32 times (VeRL's val_kwargs.n=1)
    assert (ev.samples, ev.temperature, ev.top_p, ev.every, ev.before_train) == (1, 1.0, 0.7, 5, True)
    assert (job.drafter.kind, job.spot.mode, job.bandit.algorithm) == ("auto", "idle_devices", "beg_mab")
    with pytest.raises(ValueError, match="scale='huge'"):
        config_lib.load_config_file(RECIPE, "scale=huge")


def test_tlt_dapo_is_the_recipes_algorithm_at_cpu_size(tmp_path) -> None:
    c = config_lib.load_config_file(ROOT / "configs" / "tlt.py", f"dapo,data={tmp_path / 'd.parquet'}")
    rl = c.rl
    assert (rl.prompts_per_step, rl.samples_per_prompt) == (4, 8)  # 32 rows: a group kept at 1 right in 8
    assert (rl.clip_high, rl.loss_agg) == (0.28, "token_mean")
    assert rl.dynamic_sampling and rl.filter_metric == "acc" and rl.train_short_steps
    assert (rl.gen_prompts_per_batch, rl.overlong_buffer, c.task.reward) == (4, 64, "verl")
    assert rl.lr == 1e-4  # this config's optimizer (1e-6 moves nothing in a few CPU steps)
