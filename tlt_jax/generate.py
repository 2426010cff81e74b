"""Sample from the configured model: `python -m tlt_jax.generate --config configs/default.py --prompt "..."`.

Uses the same config files as training (`config.model`, `config.rollout`), so what you see here is what RL
rollouts sample. Prints each answer and the decode throughput. Examples:

    python -m tlt_jax.generate --config configs/default.py --prompt "What is the capital of France?" \
        --config.rollout.temperature=0
    python -m tlt_jax.generate --config configs/default.py --prompt "Tell me a joke." --n 4
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from tlt_jax import config_lib
from tlt_jax.models.build import build_model_and_tokenizer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.", lock_config=True)
_PROMPT = flags.DEFINE_multi_string("prompt", None, "User message(s); each is wrapped in the chat template.")
_N = flags.DEFINE_integer("n", 1, "Samples per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Override config.rollout.max_new_tokens.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_RAW = flags.DEFINE_bool("raw", False, "Feed the prompt text as is (no chat template).")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run once first so tokens/s excludes compilation.")


def main(argv: list[str]) -> None:
    del argv
    config = _CONFIG.value
    if not _PROMPT.value:
        raise app.UsageError('give at least one --prompt "..."')
    model, tokenizer = build_model_and_tokenizer(config)
    engine = config_lib.build_engine(config, model, tokenizer)
    if _RAW.value:
        prompts = [tokenizer.encode(p) for p in _PROMPT.value]
    else:
        prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in _PROMPT.value]
    sampling = config_lib.sampling_from(config)
    max_new = _MAX_NEW.value or config.rollout.max_new_tokens

    def run() -> tuple:
        t0 = time.perf_counter()
        out = engine.generate(
            prompts, n=_N.value, key=jax.random.key(_SEED.value), sampling=sampling, max_new_tokens=max_new
        )
        return out, time.perf_counter() - t0

    if _WARMUP.value:
        _, compile_wall = run()
        print(f"warm-up (compilation) {compile_wall:.1f} s")
    out, wall = run()
    for i in range(len(out.lengths)):
        p = int(out.prompt_index[i])
        head = f"[prompt {p}" + (f", sample {i % _N.value}]" if _N.value > 1 else "]")
        print(
            f"{head} {_PROMPT.value[p]!r}\n{tokenizer.decode(out.response(i))}\n"
            f"({out.lengths[i]} tokens, finish: {out.finish_reason[i]})\n"
        )
    decode_s = out.stats.phase_seconds.get("decode", 0.0) + out.stats.phase_seconds.get("speculative", 0.0)
    decoded = int(np.sum(np.maximum(out.lengths - 1, 0)))
    print(
        f"{int(out.lengths.sum())} tokens in {wall:.2f} s; decode {decoded / max(decode_s, 1e-9):.1f} tok/s, "
        f"prefill {out.stats.phase_seconds.get('prefill', 0.0):.2f} s; {sampling}"
    )


if __name__ == "__main__":
    app.run(main)
