"""Issue 46 item 6: the drafter warm-up on the user's data and at the served run's response length, and the
spot trainer's recorded span (config level and host arithmetic only: the end-to-end warm-up runs in
tests/drafter/test_warmup.py and tests/test_documented_jobs.py)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib, config_schema, rollout_memory_plan
from tlt_jax.drafter import warmup_data
from tlt_jax.drafter.packing import DrafterSample
from tlt_jax.drafter.spot_trainer import SpotConfig, window_problems
from tlt_jax.models.config import tiny_config
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.tasks import make_task

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def warmup_config(arg: str):
    return config_lib.load_config_file(CONFIGS / "drafter_warmup.py", arg)


def test_warmup_takes_the_grpo_configs_data_keys_and_response_cap() -> None:
    """qwen7b,data=PATH is configs/qwen2_5_7b.py:dataset=parquet with --config.task.path=PATH: the same task
    section (every key, so --config.task.prompt / think / layout work), its sampling and 32K cap with its
    prompt room; response_tokens shortens it; the tlt preset takes configs/tlt.py's data= task."""
    c = warmup_config("qwen7b,policy=/m/Qwen2.5-7B,data=/d/dapo.parquet")
    grpo = config_lib.load_config_file(CONFIGS / "qwen2_5_7b.py", "dataset=parquet")
    grpo.task.path = "/d/dapo.parquet"
    assert c.task.to_dict() == grpo.task.to_dict() and c.task.layout == "verl"
    gen = c.generation
    assert gen.max_new_tokens == grpo.rollout.max_new_tokens == 32768
    assert gen.max_cache_len - gen.max_new_tokens == grpo.rollout.max_cache_len - grpo.rollout.max_new_tokens
    assert (gen.temperature, c.model.arch, c.forward.seq_len) == (
        grpo.rollout.temperature,
        "qwen2_5_7b",
        2048,
    )
    c.task.prompt, c.task.think = "r1", True  # what --config.task.prompt=r1 --config.task.think=True set
    job = config_schema.parse(c, check_paths=False, check_model=False)
    assert (job.task["kind"], job.task["prompt"], job.task["think"]) == ("parquet", "r1", True)

    short = warmup_config("qwen7b,policy=/m,dataset=parquet,response_tokens=8192").generation
    assert (short.max_new_tokens, short.max_cache_len) == (8192, 8192 + 2048)
    tlt = warmup_config("tlt,data=/d/x.parquet")
    assert (
        tlt.task.to_dict()
        == config_lib.load_config_file(CONFIGS / "tlt.py", "data=/d/x.parquet").task.to_dict()
    )


def test_warmup_refuses_data_and_lengths_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="rollout.max_new_tokens=32768"):
        warmup_config("qwen7b,policy=/m,response_tokens=40000")
    with pytest.raises(ValueError, match="needs policy="):
        warmup_config("qwen7b")
    with pytest.raises(ValueError, match="takes data=PATH"):
        warmup_config("tlt,dataset=parquet")
    c = warmup_config("qwen7b,policy=/m,dataset=parquet")  # the path is required, as in the GRPO config
    with pytest.raises(ValueError, match=r"config.task.path is empty"):
        config_schema.parse(c, check_paths=False, check_model=False)
    c.task.path, c.train.seq_len, c.drafter_eval.seq_len = "/d/x.parquet", 1024, 512
    with pytest.raises(ValueError, match=r"train.seq_len=1024.*\n.*drafter_eval.seq_len=512"):
        config_schema.parse(c, check_paths=False, check_model=False)
    c.task.kind = "parquet_files"
    with pytest.raises(ValueError, match="unknown task kind 'parquet_files'"):
        config_schema.parse(c, check_paths=False, check_model=False)

    # a prompt longer than the cache leaves beside a whole response: refused before anything is generated
    tiny = warmup_config("tiny")
    tiny.generation.max_cache_len = (
        40  # 16 tokens of prompt room beside 24: the byte-tokenized prompts need more
    )
    job = config_schema.parse(tiny)
    task, tok = make_task(job.task), ByteTokenizer()
    longest = max(len(task.encode_prompt(task.problem(i), tok)) for i in range(4))
    with pytest.raises(
        ValueError, match=f"4 of 4 warm-up prompts .* has {longest}: raise .*>= {longest + 24}"
    ):
        warmup_data.check_prompts_fit(job, task, tok, [(0, 4)])
    tiny.generation.max_cache_len = longest + 24
    warmup_data.check_prompts_fit(config_schema.parse(tiny), task, tok, [(0, 4)])


def _sample(prompt: int, response: int) -> DrafterSample:
    n = prompt + response
    hidden = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)  # row t holds t
    return DrafterSample(np.arange(n, dtype=np.int32), hidden, np.arange(n) >= prompt)


def test_cut_sample_keeps_a_window_of_a_long_response() -> None:
    rng = np.random.default_rng(0)
    fits = _sample(5, 10)
    assert warmup_data.cut_sample(fits, 16, 4, rng) is fits
    # a long prompt: the whole response and the prompt's last 16 - 10 tokens
    s = warmup_data.cut_sample(_sample(30, 10), 16, 4, rng)
    assert s.tokens.tolist() == list(range(24, 40)) and s.num_response == 10
    # a long response: 12-token windows with the 4 tokens before them, starting anywhere in the response
    starts = set()
    for _ in range(200):
        s = warmup_data.cut_sample(_sample(5, 100), 16, 4, rng)
        first = int(s.tokens[0])
        assert s.length == 16 and s.tokens.tolist() == list(range(first, first + 16))
        assert s.loss_mask.tolist() == [t >= first + 4 for t in s.tokens]  # the context carries no loss
        np.testing.assert_array_equal(s.hidden[:, 0], s.tokens)  # states stay aligned with their tokens
        starts.add(first + 4)
    assert min(starts) == 5 and max(starts) == 105 - 12 and len(starts) > 60
    empty = warmup_data.cut_sample(_sample(30, 0), 16, 4, rng)
    assert empty.tokens.tolist() == list(range(14, 30)) and empty.num_response == 0


def test_spot_window_against_the_recorded_span() -> None:
    """spot.window <= rollout.hidden_window with the spot trainer on; the paper configs record 8,192 tokens
    (the buffer draws 512-token windows at any depth of them)."""
    assert window_problems(SpotConfig(mode="between_chunks", window=512), 512) == []
    assert window_problems(SpotConfig(mode="off", window=1024), 512) == []
    (msg,) = window_problems(SpotConfig(mode="idle_devices", window=1024), 512)
    assert "config.spot.window=1024 exceeds config.rollout.hidden_window=512" in msg
    for name in ("qwen2_5_7b", "qwen2_5_32b"):
        c = config_lib.load_config_file(CONFIGS / f"{name}.py")
        spot = config_schema.section(c, "spot")
        assert c.rollout.hidden_window == 8192 and window_problems(spot, c.rollout.hidden_window) == []
        assert config_lib.engine_config_from(c).hidden_window == 8192


def test_recorded_hidden_and_warmup_memory_arithmetic() -> None:
    """Per row: min(window, max_new) x hidden x dtype bytes (Qwen2.5-7B at 8,192 of 32,768: 56 MiB, 3.5 GiB
    at 64 rows); the warm-up's cap from its KV budget, by hand for a tiny Qwen2 at its top cache bucket."""
    per_row = rollout_memory_plan.hidden_bytes_per_row
    assert per_row(8192, 32768, 3584, "bfloat16") == 8192 * 3584 * 2 == 56 * 2**20
    assert 64 * per_row(8192, 32768, 3584, "bfloat16") == 3.5 * 2**30
    assert per_row(8192, 1024, 64, "float32") == 1024 * 64 * 4
    c = warmup_config("tiny")
    c.generation.max_new_tokens, c.generation.max_cache_len, c.generation.batch_prompts = 1000, 1100, 4
    cfg = tiny_config("qwen2").replace(dtype="float32")
    kv_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 1536  # top bucket: 1,100 -> 3 x 512
    c.generation.kv_budget_gib = 3.5 * kv_row / 2**30  # holds 3 rows: a cap of 2
    m = rollout_memory_plan.warmup_memory(c, cfg)
    assert (m["cap_rows"], m["top_cache"]) == (2, 1536)
    assert m["kv_per_row"] * 2**30 == kv_row and m["hidden_per_row"] * 2**30 == 1000 * cfg.hidden_size * 4
    assert m["running"] == pytest.approx(2 * (m["kv_per_row"] + m["hidden_per_row"]))
    assert m["host_call"] == pytest.approx(4 * 2 * m["hidden_per_row"])  # batch_prompts x n rows
