"""Bad inputs, one table (issue #26): each gets ONE error that names the problem and the fix, and leaves the
workdir of an earlier run (config.json, checkpoints, metrics, a drafter warm-up) byte for byte as it was;
a damaged checkpoint is the exception, whose point is the fallback to the previous complete one.

Most cases go through `tlt_jax.main.run` in this process, the path `python -m tlt_jax.main` takes after
parsing flags, so "untouched" covers everything run does before the job starts; one case runs the CLI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import pytest
from flax import nnx

from tlt_jax import config_lib, main
from tlt_jax.config_sections import DrafterSection
from tlt_jax.models.build import build_model_and_tokenizer
from tlt_jax.models.config import tiny_config
from tlt_jax.models.drafter import Drafter
from tlt_jax.rl.checkpointing import CHECKPOINT_DIR, CORRUPT_PREFIX, restore_newest
from tlt_jax.rl.speculation import resolve_drafter
from tlt_jax.utils import distributed
from tlt_jax.utils.checkpoint import Checkpointer
from tlt_jax.utils.drafter_checkpoint import DrafterCheckpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = (2, 4)  # the earlier run's checkpoints
POLICY = tiny_config("llama", vocab_size=264)
OTHER = tiny_config("llama", vocab_size=300, hidden_size=96, intermediate_size=160)  # another model's drafter


def smoke(**overrides: object) -> ml_collections.ConfigDict:
    """configs/smoke.py with `overrides` ("rl.lr" -> value); the test session's compilation cache kept."""
    c = config_lib.load_config_file(ROOT / "configs" / "smoke.py")
    c.compilation_cache_dir = ""
    for key, value in overrides.items():
        *path, last = key.split(".")
        section = c
        for p in path:
            section = section[p]
        section[last] = value
    return c


def state(step: int) -> dict:
    return {"params": {"w": jnp.full((16, 8), float(step))}, "rng": jax.random.key(step)}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> pathlib.Path:
    """The workdir of an earlier smoke run: config.json, two checkpoints, metrics, a drafter warm-up."""
    wd = tmp_path_factory.mktemp("earlier_run")
    main.write_config(smoke(), str(wd))
    with Checkpointer(wd / CHECKPOINT_DIR, async_save=False) as ckpt:
        for step in STEPS:
            ckpt.save(step, state(step), {"step": step})
    (wd / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "reward/mean": 0.5}}\n' for s in (1, 2, 3, 4)))
    drafter = Drafter(OTHER, nnx.Rngs(0))  # warmed up for OTHER, not for POLICY
    with DrafterCheckpointer(wd / "warmup" / "drafter", async_save=False) as ckpt:
        ckpt.save(1, nnx.to_pure_dict(nnx.state(drafter, nnx.Param)), {"target": dataclasses.asdict(OTHER)})
    return wd


def digest(root: pathlib.Path) -> dict[str, str]:
    """Every file's sha256 and every folder, by path under `root`."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@contextlib.contextmanager
def warnings_text() -> Iterator[list[str]]:
    """The absl warnings logged inside the block."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("absl")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def without_launch_variables() -> Iterator[None]:
    names = [n for n in os.environ if n.startswith(("TLT_JAX_", "SLURM_"))]
    saved = {n: os.environ.pop(n) for n in names}
    try:
        yield
    finally:
        os.environ.update(saved)


# ---- the acts: each does one bad thing with the earlier run's workdir `wd` -------------------------------


def run_with(**overrides: object) -> Callable[[pathlib.Path], object]:
    return lambda wd: main.run(smoke(**overrides), str(wd))


def typo_in_config_file(wd: pathlib.Path) -> object:
    c = smoke()
    c.rl.lerning_rate = 1e-5  # a config file's typo: the ConfigDict takes the new key silently
    return main.run(c, str(wd))


def on_command_line(*overrides: str) -> Callable[[pathlib.Path], object]:
    """`python -m tlt_jax.main` on the smoke config with `overrides` (8 fake devices, as this process)."""
    return lambda wd: cli(wd, *overrides)


def cli(wd: pathlib.Path, *overrides: str) -> object:
    cmd = [sys.executable, "-m", "tlt_jax.main", "--config", str(ROOT / "configs" / "smoke.py")]
    cmd += [*overrides, "--workdir", str(wd)]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    raise ValueError(proc.stderr)  # the CLI's message, checked like the others


def malformed_task_line(wd: pathlib.Path) -> object:
    path = wd.parent / "train.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n\n{"question": "2+2?", "anwser": "4"}\n')
    return main.run(smoke(task=ml_collections.ConfigDict(dict(kind="jsonl", path=str(path)))), str(wd))


def prompt_longer_than_cache(wd: pathlib.Path) -> object:
    config = smoke()  # max_cache_len=128, max_new_tokens=16
    model, tokenizer = build_model_and_tokenizer(config)
    engine = config_lib.build_engine(config, model, tokenizer)
    prompts = [[1] * 10, [1] * 120]
    return engine.generate(prompts, n=1, key=jax.random.key(0), sampling=config_lib.sampling_from(config))


def drafter_from_another_model(wd: pathlib.Path) -> object:
    section = DrafterSection(kind="eagle", path=str(wd / "warmup"), min_accept_len=1.0)
    return resolve_drafter(section, POLICY)


def multiprocess_without_coordinator(wd: pathlib.Path) -> object:
    with without_launch_variables():
        return main.run(smoke(multiprocess=True), str(wd))


def damaged_checkpoint(damage: Callable[[pathlib.Path], None]) -> Callable[[pathlib.Path], str]:
    """Damage the newest step; restoring must fall back to the previous one, say so, and keep the damaged
    step (moved aside) while the previous one stays as it was."""

    def act(wd: pathlib.Path) -> str:
        ckpts = wd / CHECKPOINT_DIR
        damage(ckpts / str(STEPS[-1]))
        previous = digest(ckpts / str(STEPS[0]))
        with Checkpointer(ckpts, async_save=False) as ckpt, warnings_text() as warned:
            step, (restored, meta) = restore_newest(ckpt, lambda s: ckpt.restore(s, state(s)))
            assert step == STEPS[0] and meta["step"] == STEPS[0] and float(restored["params"]["w"][0, 0]) == 2
            assert ckpt.all_steps() == [STEPS[0]]
            assert ckpt.save(STEPS[-1], state(STEPS[-1])).saved  # the run goes on and writes that step anew
        moved = ckpts / f"{CORRUPT_PREFIX}{STEPS[-1]}"
        assert moved.is_dir() and any(moved.rglob("*")), "the damaged step was not kept"
        assert digest(ckpts / str(STEPS[0])) == previous
        return "\n".join(warned)

    return act


def truncate_largest_array_file(step_dir: pathlib.Path) -> None:
    big = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(big, big.stat().st_size // 2)


# ---- the table --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    act: Callable[[pathlib.Path], object]
    says: tuple[str, ...]  # regexes the message must contain: the problem, and the fix
    error: type[BaseException] | None = ValueError  # None: a fallback, checked by the act (workdir changes)


CASES = {
    "unknown_key_in_config_file": Case(
        typo_in_config_file,
        (r"config\.rl\.lerning_rate is not a config key", r"did you mean config\.rl\.lr\?", r"Fix its name"),
    ),
    "unknown_key_on_command_line": Case(
        on_command_line("--config.rl.lerning_rate=1e-5"),
        (r"unknown config key: 'lerning_rate'", r"did you mean config\.rl\.lr\?", r"config\.rl has: .*lr"),
    ),
    "negative_learning_rate": Case(run_with(**{"rl.lr": -1e-5}), (r"config\.rl\.lr=-1e-05: must be > 0",)),
    "temperature_zero": Case(
        run_with(**{"rollout.temperature": 0.0}),
        (r"config\.rollout\.temperature=0\.0: GRPO needs sampling \(> 0; the paper uses 0\.9\)",),
    ),
    "top_p_above_one": Case(
        run_with(**{"rollout.top_p": 1.5}), (r"config\.rollout\.top_p=1\.5.*need 0 < top_p <= 1",)
    ),
    "group_size_one": Case(
        run_with(**{"rl.samples_per_prompt": 1, "trainer.micro_batch_size": 2}),
        (r"config\.rl\.samples_per_prompt=1: GRPO compares samples within a group, use >= 2",),
    ),
    "chunk_steps_zero": Case(
        run_with(**{"rollout.chunk_steps": 0}), (r"config\.rollout\.chunk_steps=0: must be >= 1",)
    ),
    "malformed_task_line": Case(
        malformed_task_line,
        (
            r"train\.jsonl:3: missing field 'answer' \(fields present: \['anwser', 'question'\]\)",
            r"Each line must be one JSON object .* fix or remove line 3",
        ),
    ),
    "prompt_longer_than_cache": Case(
        prompt_longer_than_cache,
        (r"prompt 1 has 120 tokens", r"max_cache_len=128", r"Raise config\.rollout\.max_cache_len to >= 136"),
    ),
    "drafter_from_another_model": Case(
        drafter_from_another_model,
        (
            r"does not fit the policy \(drafter vs policy: hidden_size 96 vs 64, intermediate_size 160 vs "
            r"128, vocab_size 300 vs 264\)",
            r"warm one up for this policy with `\S*python\S* -m tlt_jax\.main --config "
            r"configs/drafter_warmup\.py",
        ),
    ),
    "truncated_checkpoint": Case(
        damaged_checkpoint(truncate_largest_array_file),
        (r"checkpoint step 4 in .* is unreadable .* while step 2 restores: moved it to .*corrupt-4",),
        error=None,
    ),
    "checkpoint_missing_metadata": Case(
        damaged_checkpoint(lambda step_dir: (step_dir / "meta" / "metadata").unlink()),
        (r"step 4 .* is unreadable \(FileNotFoundError.*metadata.* moved it to .*corrupt-4 .*from step 2",),
        error=None,
    ),
    "workdir_config_differs": Case(
        run_with(**{"rl.lr": 0.02, "rollout.temperature": 0.7, "num_steps": 9}),
        (
            r"holds a run started with another config",
            r"config\.rl\.lr: 0\.01 -> 0\.02\n    config\.rollout\.temperature: 1\.0 -> 0\.7\n  Resuming",
            r"Use a new --workdir for this config.*or pass --allow_config_change",
        ),
    ),
    "mesh_not_dividing_devices": Case(
        run_with(**{"mesh.model": 3}),
        (
            r"config\.mesh\.model=3 does not divide the 8 devices",
            r"set config\.mesh\.model to one of \[1, 2, 4, 8\], or config\.mesh\.data explicitly",
        ),
    ),
    "mesh_not_dividing_devices_on_command_line": Case(
        on_command_line("--config.mesh.model=3"),
        (
            r"error: mesh: config\.mesh\.model=3 does not divide the 8 devices",
            r"set config\.mesh\.model to one of \[1, 2, 4, 8\]",
        ),
    ),
    "multiprocess_without_coordinator": Case(
        multiprocess_without_coordinator,
        (
            r"config\.multiprocess=True but the distributed launch is not fully described: missing the "
            r"coordinator address",
            f"Set {distributed.COORDINATOR}=<host of process 0>:<free port>.*or run one process with "
            r"config\.multiprocess=False",
        ),
    ),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_bad_input_gets_one_clear_error_and_leaves_the_workdir(name, template, tmp_path) -> None:
    case = CASES[name]
    wd = tmp_path / "workdir"
    shutil.copytree(template, wd)
    before = digest(wd)
    if case.error is None:
        message = case.act(wd)
    else:
        with pytest.raises(case.error) as e:
            case.act(wd)
        message = str(e.value)
        assert digest(wd) == before, "the bad input changed the workdir"
    for pattern in case.says:
        assert re.search(pattern, message, re.S), f"{pattern!r} not in:\n{message}"


def test_an_allowed_config_change_resumes_and_lists_the_changes(template) -> None:
    """With --allow_config_change, the same difference is listed instead of refused; keys a resume may change
    (num_steps) are not listed."""
    from tlt_jax.utils.config_checks import check_workdir_config

    changes = check_workdir_config(smoke(**{"rl.lr": 0.02, "num_steps": 9}), template, allow_change=True)
    assert changes == ["config.rl.lr: 0.01 -> 0.02"]
