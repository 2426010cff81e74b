"""The history drafter in the RL loop (config.drafter.kind=history) on the smoke config with every step a new
epoch of the same two prompts: GRPO steps equal plain decoding's in float32 while drafting from the earlier
epochs, and a run resumed from its checkpoint drafts exactly the trees the uninterrupted run drafted (the
store's responses are in the checkpoint)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tlt_jax import config_lib
from tlt_jax.rl.learner import Learner

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def smoke(kind: str, steps: int):
    c = config_lib.load_config_file(CONFIGS / "smoke.py", f"steps={steps}")
    c.task["size"] = 2  # = prompts_per_step: every step revisits both prompts (a new epoch)
    c.drafter.kind = kind
    return c


def run(workdir: pathlib.Path, kind: str, steps: int, drafts: dict[int, list] | None = None) -> list[dict]:
    """Step metrics until `steps` (resuming from workdir's checkpoint if any; nothing saved); with `drafts`,
    record every tree the history store drafts, by step (a spy: the store's own `draft` runs and its outputs
    are kept)."""
    learner = Learner(smoke(kind, steps), str(workdir))
    try:
        store = learner.engine.history
        if drafts is not None:
            draft = store.draft

            def spy(*args):
                out = draft(*args)
                drafts.setdefault(learner.step + 1, []).append([np.array(x) for x in out])
                return out

            store.draft = spy
        return [learner.train_step() for _ in range(learner.step, steps)]
    finally:
        learner.close()


@pytest.mark.slow  # ~35 s: scheduled first (tests/conftest.py)
def test_history_drafts_equal_plain_and_a_resumed_run_drafts_the_same(tmp_path) -> None:
    plain = run(tmp_path / "plain", "none", 3)
    full: dict[int, list] = {}
    hist = run(tmp_path / "history", "history", 3, full)
    for a, b in zip(plain, hist, strict=True):  # coupled verification: the same samples, the same step
        assert a["reward/mean"] == b["reward/mean"] and a["length/mean"] == b["length/mean"]
        np.testing.assert_allclose(a["loss/pg"], b["loss/pg"], rtol=1e-4, atol=1e-6)
    assert all(m["spec/verify_rounds"] > 0 for m in hist)
    assert hist[-1]["history/responses"] == 3 * 16 and hist[-1]["history/host_mib"] > 0
    # later epochs match more of their context in the history than the first
    assert hist[2]["history/match_len"] > hist[0]["history/match_len"], [m["history/match_len"] for m in hist]

    resumed: dict[int, list] = {}
    first = Learner(smoke("history", 2), str(tmp_path / "resumed"))
    assert first.train() == "done"  # saves step 2 and closes: the resumed run starts from its checkpoint
    again = run(tmp_path / "resumed", "history", 3, resumed)
    assert len(again) == 1 and sorted(resumed) == [3]
    assert len(resumed[3]) == len(full[3])
    for got, want in zip(resumed[3], full[3], strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    assert again[0]["reward/mean"] == hist[2]["reward/mean"]
