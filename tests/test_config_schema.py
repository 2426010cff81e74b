"""The config schema (tlt_jax/config_schema.py): one place for every key's type and default, each section
parsed into its typed object once, every config file of the repository parsed, the warm-up's sections part of
the same schema, one threshold switch."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from tlt_jax import config_lib, config_schema
from tlt_jax.config_schema import JOB_SCHEMA, SECTIONS, SPEC_FROM_DRAFTER, GrpoConfig
from tlt_jax.drafter.warmup_config import WarmupConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("job", sorted(JOB_SCHEMA))
def test_base_config_is_the_section_dataclasses_defaults(job: str) -> None:
    """Defaults are stated once: each section of `base_config(job)` has exactly its dataclass's fields, at
    the dataclass's defaults (the top level is the job's run section)."""
    base = config_schema.base_config(job).to_dict()
    run_cls, names = JOB_SCHEMA[job]
    sections = {n: SECTIONS[n] for n in names if n != "task"}
    top = {k: v for k, v in base.items() if k not in names}
    assert top == {f.name: default(f) for f in dataclasses.fields(run_cls)}
    for name, cls in sections.items():
        fields = {
            f.name: default(f)
            for f in dataclasses.fields(cls)
            if not (name == "spec" and f.name in SPEC_FROM_DRAFTER)
        }
        assert base[name] == fields, name


def default(f: dataclasses.Field) -> object:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_section_name_means_one_class() -> None:
    """The two jobs share model, mesh and task; no section name has two meanings (the warm-up's held-out
    acceptance is `drafter_eval`, the GRPO job's held-out reward `eval`)."""
    grpo, warmup = (set(JOB_SCHEMA[j][1]) for j in ("grpo", "drafter_warmup"))
    assert grpo & warmup == {"model", "mesh", "task"}
    assert len(set(SECTIONS.values())) == len(SECTIONS)


@pytest.mark.parametrize(
    "name,arg",
    [("tlt", None), ("smoke", None), ("default", None), ("qwen2_5_7b", None), ("qwen2_5_32b", None),
     ("qwen2_5_0_5b", None), ("qwen2_5_7b_tpu", None), ("drafter_warmup", None), ("drafter_warmup", "tiny"),
     ("drafter_warmup", "tlt")],
)  # fmt: skip
def test_every_config_file_parses_into_typed_sections(name: str, arg: str | None) -> None:
    config = config_lib.load_config_file(CONFIGS / f"{name}.py", arg)
    job = config_schema.parse(config, check_paths=False, check_model=False)
    expected = GrpoConfig if config.job == "grpo" else WarmupConfig
    assert isinstance(job, expected) and job.raw is config
    for section in JOB_SCHEMA[config.job][1]:
        if section != "task":
            assert isinstance(getattr(job, section), SECTIONS[section]), section


def test_problems_of_several_sections_are_listed_together() -> None:
    c = config_lib.load_config_file(CONFIGS / "smoke.py")
    c.rl.lr = 0.0
    c.rollout.chunk_steps = 0
    c.trainer.master_dtype = "float8"
    c.bandit.algorithm = "threshold"
    c.wandb.project = "x"
    with pytest.raises(ValueError) as e:
        config_schema.parse(c)
    msg = str(e.value)
    assert "config.rl.lr=0.0: must be > 0" in msg
    assert "config.rollout.chunk_steps=0: must be >= 1" in msg
    assert "config.trainer.master_dtype='float8'" in msg
    assert "the threshold switch is config.spec.threshold / min_steps_below" in msg


def test_the_warmup_rejects_its_old_eval_section_by_name() -> None:
    c = config_lib.load_config_file(CONFIGS / "drafter_warmup.py", "tiny")
    assert config_schema.parse(c).drafter_eval.before is True
    c.eval = c.drafter_eval.to_dict()
    with pytest.raises(
        ValueError, match=r"config.eval is not a config key: did you mean config.drafter_eval"
    ):
        config_schema.parse(c)


def test_a_section_becomes_its_object_in_one_place() -> None:
    """`section(config, name)` is what the builders use; the learner gets the same objects from `parse`."""
    c = config_lib.load_config_file(CONFIGS / "tlt.py", "quick")
    job = config_schema.parse(c, check_paths=False)
    for name in ("rollout", "drafter", "spot", "bandit", "eval", "rl", "trainer"):
        assert config_schema.section(c, name) == getattr(job, name), name
    assert config_lib.engine_config_from(c) == job.engine_config()
    assert config_lib.sampling_from(c) == job.rollout.sampling()
    assert job.spec_for("none").enabled is False and job.spec_for("eagle").drafter == "eagle"
