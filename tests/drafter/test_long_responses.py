"""Issue 46 item 6: the drafter warm-up on the user's data and at the served run's response length, and the
spot trainer's recorded span (config level and host arithmetic only: the end-to-end warm-up runs in
tests/drafter/test_warmup.py and tests/test_documented_jobs.py)."""

from __future__ import annotations

import json
import pathlib

import ml_collections
import numpy as np
import pytest

from tlt_jax import config_lib, config_schema, rollout_memory_plan
from tlt_jax.drafter import warmup_data
from tlt_jax.drafter.buffer import DrafterBuffer
from tlt_jax.drafter.packing import DrafterSample
from tlt_jax.drafter.spot_trainer import SpotConfig, samples_from, window_problems
from tlt_jax.models.config import tiny_config
from tlt_jax.models.tokenizer import ByteTokenizer
from tlt_jax.rl.config import validate_grpo
from tlt_jax.rollout import admission
from tlt_jax.rollout.hooks import FinishedSequences
from tlt_jax.tasks import make_task
from tlt_jax.tasks.base import PromptLimit

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


def test_dapo7b_warmup_serves_the_dapo_recipe() -> None:
    """dapo7b,policy=DIR,data=PATH warms a drafter for configs/recipes/dapo_qwen2_5_7b.py: the recipe's task
    section on that file, its temperature 1.0 and 20,480-token response cap, the 7B target's shapes."""
    c = warmup_config("dapo7b,policy=/m/Qwen2.5-7B,data=/d/train.parquet")
    recipe = config_lib.load_config_file(CONFIGS / "recipes" / "dapo_qwen2_5_7b.py", "dataset=parquet")
    recipe.task.path = "/d/train.parquet"
    assert c.task.to_dict() == recipe.task.to_dict()
    assert (
        (c.generation.max_new_tokens, c.generation.temperature)
        == (20480, 1.0)
        == (
            recipe.rollout.max_new_tokens,
            recipe.rollout.temperature,
        )
    )
    assert (c.model.path, c.model.arch) == ("/m/Qwen2.5-7B", "qwen2_5_7b")
    with pytest.raises(ValueError, match="needs policy="):
        warmup_config("dapo7b,data=/d/train.parquet")


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


def test_warmup_drops_prompts_that_do_not_fit(tmp_path) -> None:
    """A prompt longer than the engine's prompt room (generation.max_cache_len - max_new_tokens) is dropped
    when the data loads (counted), on the GRPO learner's path (tasks.prompt_fit); truncation=error without
    the filter refuses the data naming the rows. Never a crash inside generation."""
    path = tmp_path / "d.jsonl"
    questions = [f"add {'1 + ' * k}1" for k in (1, 40, 2, 60, 3)]  # two are long
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in questions))
    tiny = warmup_config("tiny")
    tiny.task = ml_collections.ConfigDict(dict(kind="jsonl", path=str(path)))
    task, tok = make_task(tiny.task), ByteTokenizer()
    lengths = [len(task.encode_prompt(task.problem(i), tok)) for i in range(len(task))]
    room = sorted(lengths)[2]  # three fit
    tiny.generation.max_cache_len = room + tiny.generation.max_new_tokens
    job = config_schema.parse(tiny)
    fitted, dropped = warmup_data.fit_task(job, task, tok)
    assert (dropped, len(fitted)) == (2, 3)
    assert sorted(len(fitted.encode_prompt(fitted.problem(i), tok)) for i in range(3)) == sorted(lengths)[:3]
    task.prompt_limit = PromptLimit(filter=False, truncation="error")
    with pytest.raises(ValueError, match=f"2 of 5 prompts are longer than {room} tokens.*truncation=error"):
        warmup_data.fit_task(job, task, tok)


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
    """spot.window <= rollout.hidden_window with the spot trainer on, checked when the config is validated;
    the paper configs record 8,192 (7B) / 2,048 (32B) tokens at a per-row random depth of the response
    (the buffer draws 512-token windows at any depth of them), streamed to the spot trainer."""
    assert window_problems(SpotConfig(mode="between_chunks", window=512), 512) == []
    assert window_problems(SpotConfig(mode="off", window=1024), 512) == []
    (msg,) = window_problems(SpotConfig(mode="idle_devices", window=1024), 512)
    assert "config.spot.window=1024 exceeds config.rollout.hidden_window=512" in msg
    for name, window in (("qwen2_5_7b", 8192), ("qwen2_5_32b", 2048)):
        c = config_lib.load_config_file(CONFIGS / f"{name}.py")
        spot = config_schema.section(c, "spot")
        assert window_problems(spot, c.rollout.hidden_window) == []
        ec = config_lib.engine_config_from(c)
        assert (ec.hidden_window, ec.hidden_span, ec.keep_hidden) == (window, "random", False)
    # a config error at validation, listed with the others (not when the spot trainer is built)
    smoke = config_lib.load_config_file(CONFIGS / "smoke.py")
    smoke.spot.mode, smoke.spot.window, smoke.rollout.hidden_span = "between_chunks", 1024, "middle"
    with pytest.raises(ValueError, match=r"hidden_span='middle'.*\n.*spot.window=1024 exceeds"):
        validate_grpo(smoke, check_paths=False)


def test_spot_samples_of_a_later_span_keep_their_tokens() -> None:
    """A span recorded from response token k (rollout.hidden_span random / last) becomes a sample of response
    tokens k.. with their own states (row j: token k + j's), its first min(context, span - window) tokens
    the window's context; a span after the prompt keeps the prompt before it. Then the buffer's window."""
    hid = lambda a, n: np.arange(a, a + n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # noqa: E731
    toks = np.arange(100, 140, dtype=np.int32)  # response token p is 100 + p; its state holds p
    seqs = FinishedSequences(
        seq_ids=np.arange(3), prompt_index=np.zeros(3, np.int64), prompt_tokens=[[7, 8, 9]] * 3,
        tokens=[toks, toks, toks[:6]], logprobs=[np.zeros(40)] * 3, finish_reason=["length"] * 3,
        hidden=[hid(20, 12), hid(30, 4), hid(0, 5)], prompt_hidden=[-np.ones((3, 2), np.float32)] * 3,
        hidden_offset=np.asarray([20, 30, 0]),
    )  # fmt: skip
    deep, short, head = samples_from(seqs, window=8, context=3)
    assert deep.tokens.tolist() == list(range(120, 132)) and deep.hidden[:, 0].tolist() == list(range(20, 32))
    assert deep.loss_mask.tolist() == [False] * 3 + [True] * 9  # context min(3, 12 - 8)
    assert short.tokens.tolist() == [130, 131, 132, 133] and short.loss_mask.all()  # span <= window
    assert head.tokens.tolist() == [7, 8, 9, 100, 101, 102, 103, 104] and head.num_response == 5
    buf = DrafterBuffer(max_tokens=64, window=8, context=3)
    buf.add([deep], step=0, response_lens=[40])
    (w,) = buf.samples()
    np.testing.assert_array_equal(w.hidden[:, 0], w.tokens - 100)  # every pair is still a token and its state
    assert w.length == 11 and w.num_response == 8 and buf._current[0].response_len == 40


def test_recorded_hidden_and_warmup_memory_arithmetic() -> None:
    """Per row: min(window, max_new) x hidden x dtype bytes (Qwen2.5-7B at 8,192 of 32,768: 56 MiB, 3.5 GiB
    at 64 rows); the warm-up's cap from its KV budget, by hand for a tiny Qwen2 at its top cache bucket."""
    per_row = admission.hidden_bytes_per_row
    assert per_row(8192, 32768, 3584, "bfloat16") == 8192 * 3584 * 2 == 56 * 2**20
    assert 64 * per_row(8192, 32768, 3584, "bfloat16") == 3.5 * 2**30
    assert per_row(8192, 1024, 64, "float32") == 1024 * 64 * 4
    c = warmup_config("tiny")
    c.generation.max_new_tokens, c.generation.max_cache_len, c.generation.batch_prompts = 1000, 1100, 4
    cfg = tiny_config("qwen2").replace(dtype="float32")
    kv_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 1536  # top bucket: 1,100 -> 3 x 512
    hid_row = 1000 * cfg.hidden_size * 4  # 256,000 B of recorded states beside 786,432 of KV
    c.generation.kv_budget_gib = 4.5 * kv_row / 2**30  # KV alone: 4 rows; with the states 3.4: a cap of 2
    m = rollout_memory_plan.warmup_memory(c, cfg)
    assert (m["cap_rows"], m["top_cache"]) == (2, 1536)
    assert m["kv_per_row"] * 2**30 == kv_row and m["hidden_per_row"] * 2**30 == hid_row
    assert m["running"] == pytest.approx(2 * (m["kv_per_row"] + m["hidden_per_row"]))
    assert m["host_call"] == pytest.approx(4 * 2 * m["hidden_per_row"])  # batch_prompts x n rows
    assert m["host_harvest"] == pytest.approx(2 * m["hidden_per_row"])  # streamed: the running rows at most


def test_running_rows_cap_counts_the_recorded_states() -> None:
    """Qwen2.5-7B under TP 4 with the EAGLE layer at the top bucket 35,328: 29 x 2 x 1 x 128 x 2 = 14,848 B
    per token, 524,550,144 B of KV per row, plus 8,192 x 3,584 x 2 = 58,720,256 B of recorded states:
    583,270,400 B (0.5432 GiB). A 34 GiB budget holds 69.6 rows of KV alone (cap 64) but 62.6 with the
    states (cap 32); the paper config's 40 GiB holds 73.6 (cap 64, 34.8 GiB in use)."""
    kv_token, states = 29 * 2 * 1 * 128 * 2, admission.hidden_bytes_per_row(8192, 32768, 3584, "bfloat16")
    assert states == 58_720_256 and kv_token * 35_328 == 524_550_144
    assert admission.running_rows_cap(0, 34.0, kv_token, 35_328)[0] == 64
    cap, line = admission.running_rows_cap(0, 34.0, kv_token, 35_328, states)
    assert cap == 32 and "recorded states 0.055 GiB" in line and "17.38 GiB in use" in line
    assert admission.running_rows_cap(0, 40.0, kv_token, 35_328, states)[0] == 64
    with pytest.raises(ValueError, match="holds no row.*recorded states"):
        admission.running_rows_cap(0, 0.5, kv_token, 35_328, states)
