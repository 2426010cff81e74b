"""The rollout programs' numerics: a float32 engine computes every dot at full precision whatever the
process default is (XLA on GPUs defaults to TF32-class float32 dots, which broke coupled verification there).

Read from the lowered StableHLO of every program the engine compiles (prefill, plain chunk, EAGLE chain and
tree chunks, n-gram chunk), with the process default set to bfloat16 while the programs are traced. The
projections and attention take the XLA paths the GPU takes (`linear_impl="xla"`, `attn_impl="reference"`),
so the programs hold the dots a GPU runs rather than this CPU's FFI kernels.
"""

from __future__ import annotations

import re

import jax
import pytest

from tlt_jax.models.config import tiny_config
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.hooks import FixedMode
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.programs import program_precision
from tlt_jax.rollout.sampling import SamplingParams

PROMPTS = [[1, 5, 6, 7], [1, 9, 9, 2, 4]]
_DOT = re.compile(r"stablehlo\.(dot_general|dot|convolution)\b.*")
_HIGHEST = "precision = [HIGHEST, HIGHEST]"


def _dots(text: str) -> list[str]:
    return [m.group(0) for m in _DOT.finditer(text)]


def _programs(mirror, matmul_precision: str, dtype: str = "float32") -> dict[str, str]:
    """{program name: lowered text} of a greedy rollout in every mode, traced under a bfloat16 default."""
    cfg = tiny_config(num_layers=1, tie_embeddings=False, linear_impl="xla", dtype=dtype)
    target = mirror.target(cfg)
    engine = RolloutEngine(
        target,
        EngineConfig(
            max_new_tokens=12,
            max_cache_len=64,
            chunk_steps=4,
            compact=False,
            attn_impl="reference",
            matmul_precision=matmul_precision,
        ),
        eos_ids=[],
        drafter=mirror.drafter(target, noise=0.05),
    )
    engine.programs.keep_text = True
    modes = ["plain", engine.add_mode("eagle", "2_1_3"), engine.add_mode("eagle", "2_2_4")]
    modes.append(engine.add_mode("ngram", "2_1_3"))
    with jax.default_matmul_precision("bfloat16"):
        for mode in modes:
            engine.generate(
                PROMPTS, n=1, key=jax.random.key(0), sampling=SamplingParams(0.9), hooks=FixedMode(mode)
            )
    return engine.programs.texts()


def test_float32_rollout_programs_compute_every_dot_at_full_precision(mirror):
    texts = _programs(mirror, "auto")
    kinds = {name.split("/")[0] for name in texts}
    assert {"prefill", "chunk"} <= kinds, sorted(texts)
    # chunk keys: chunk/batch bucket/cache bucket/tokens_to_verify/strategies/...: T > 1 is speculative
    spec = [n for n in texts if n.startswith("chunk/") and n.split("/")[3] != "1"]
    assert len(spec) == 2, f"expected the T=3 (EAGLE chain, n-gram) and T=4 (tree) programs: {sorted(texts)}"
    for name, text in texts.items():
        dots = _dots(text)
        if name.split("/")[0] in ("prefill", "chunk"):
            assert dots, f"{name}: no dot in the lowered program (did the matmuls move to a custom call?)"
        loose = [d for d in dots if _HIGHEST not in d]
        assert not loose, f"{name}: {len(loose)} of {len(dots)} dots below full precision, e.g. {loose[0]}"


def test_default_precision_follows_the_process_default(mirror):
    """The control: with matmul_precision="default" the same programs take the (bfloat16) process default,
    so the check above can fail."""
    texts = _programs(mirror, "default")
    dots = [d for text in texts.values() for d in _dots(text)]
    assert dots and not any(_HIGHEST in d for d in dots)


@pytest.mark.parametrize(
    "name,dtype,want",
    [("auto", "float32", "highest"), ("auto", "bfloat16", None), ("default", "float32", None)],
)
def test_program_precision(name, dtype, want):
    assert program_precision(name, dtype) == want


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="matmul_precision='fp64'"):
        EngineConfig(matmul_precision="fp64")
