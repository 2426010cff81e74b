"""The config schema: every key a job reads, with its type and default, stated once.

A config is an `ml_collections.ConfigDict`: config files start from `base_config(job)` and override what they
need, the command line overrides keys. Each section is one frozen dataclass (a `Section`): its fields are the
section's keys, their defaults THE defaults (the base config is made from them), and its checks run when it
is built, so an invalid section never becomes an object. `parse(config)` builds every section of the config's
job in one place and raises one ValueError listing every problem (unknown keys with the nearest valid ones,
each section's own checks, the checks across sections).

    job          sections (typed object)
    grpo         model mesh task rollout drafter spec spot bandit eval rl trainer wandb  -> GrpoConfig
    drafter_warmup  model mesh task generation forward train drafter_eval               -> WarmupConfig

Shared sections (model, mesh, task) are the same classes in both jobs. `config.task` and `config.model.random`
are open (the task kind's constructor arguments; `ModelConfig` fields). The GRPO job adds its own checks
across sections in `tlt_jax.rl.config.validate_grpo`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import ml_collections as mlc

from tlt_jax.config_sections import (
    JOBS,
    DrafterSection,
    EvalConfig,
    MeshSection,
    ModelSection,
    RLSection,
    RolloutSection,
    RunSection,
    TrainerSection,
    WandbSection,
)
from tlt_jax.drafter.eagle_format import init_from_problems
from tlt_jax.drafter.spot_trainer import SpotConfig
from tlt_jax.drafter.warmup_config import (
    DrafterEvalSection,
    ForwardSection,
    GenerationSection,
    WarmupConfig,
    WarmupRunSection,
    WarmupTrainSection,
)
from tlt_jax.models.build import model_problems
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.selector_config import BanditSection
from tlt_jax.rollout.strategy import SpecConfig
from tlt_jax.utils.config_checks import (
    SectionError,
    build_section,
    section_defaults,
    unknown_key_problems,
)
from tlt_jax.utils.plain import plain_dict

SPEC_FROM_DRAFTER = ("enabled", "drafter")  # SpecConfig fields that config.drafter.kind decides
OPEN_SECTIONS = ("model.random", "task", "eval.sets")  # sections whose keys are not fixed


# the schema: section name -> its class, per job (the top level is the job's run section)
SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "mesh": MeshSection,
    "rollout": RolloutSection,
    "drafter": DrafterSection,
    "spec": SpecConfig,
    "spot": SpotConfig,
    "bandit": BanditSection,
    "eval": EvalConfig,
    "rl": RLSection,
    "trainer": TrainerSection,
    "wandb": WandbSection,
    "generation": GenerationSection,
    "forward": ForwardSection,
    "train": WarmupTrainSection,
    "drafter_eval": DrafterEvalSection,
}
JOB_SCHEMA: dict[str, tuple[type, tuple[str, ...]]] = {
    "grpo": (
        RunSection,
        (
            "model",
            "mesh",
            "task",
            "rollout",
            "drafter",
            "spec",
            "spot",
            "bandit",
            "eval",
            "rl",
            "trainer",
            "wandb",
        ),
    ),  # fmt: skip
    "drafter_warmup": (
        WarmupRunSection,
        ("model", "mesh", "task", "generation", "forward", "train", "drafter_eval"),
    ),  # fmt: skip
}
DEFAULT_TASK = {
    "grpo": {"kind": "counting"},
    "drafter_warmup": {"kind": "reasoning_gym", "name": "chain_sum"},
}


def base_config(job: str = "grpo") -> mlc.ConfigDict:
    """Every key `job` reads, with the schema's defaults; config files override what they need."""
    if job not in JOB_SCHEMA:
        raise ValueError(f"config.job={job!r}: use one of {JOBS}.")
    run, names = JOB_SCHEMA[job]
    c = section_defaults(run)  # its `job` default is the job's name
    for name in names:
        if name == "task":
            c.task = mlc.ConfigDict(DEFAULT_TASK[job])
        else:
            c[name] = section_defaults(SECTIONS[name], drop=SPEC_FROM_DRAFTER if name == "spec" else ())
    return c


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
    """A GRPO job's config, every section typed (`parse`); `raw` is the ConfigDict as given (config.json,
    wandb, the workdir check). `spec` has SD on for drafter kinds ngram/eagle ("auto" is resolved against
    the drafter path by the learner: `spec_for`)."""

    raw: mlc.ConfigDict
    run: RunSection
    model: ModelSection
    mesh: MeshSection
    task: Mapping[str, object]
    rollout: RolloutSection
    drafter: DrafterSection
    spec: SpecConfig
    spot: SpotConfig
    bandit: BanditSection
    eval: EvalConfig
    rl: RLSection
    trainer: TrainerSection
    wandb: WandbSection

    def spec_for(self, drafter_kind: str) -> SpecConfig:
        """`spec` for a resolved drafter kind (none | ngram | eagle)."""
        return spec_for_kind(self.spec, drafter_kind)

    def engine_config(self, drafter_kind: str | None = None) -> EngineConfig:
        """The rollout engine's settings (hidden states recorded whenever the spot trainer runs)."""
        spec = self.spec if drafter_kind is None else self.spec_for(drafter_kind)
        return self.rollout.engine_config(spec, record_hidden=self.spot.mode != "off")


def spec_for_kind(spec: SpecConfig, drafter_kind: str) -> SpecConfig:
    """SD on for drafter kinds "ngram", "history" and "eagle", off for "none" ("auto" counts as ngram until
    resolved)."""
    kind = "ngram" if drafter_kind == "auto" else drafter_kind
    return dataclasses.replace(
        spec,
        enabled=kind in ("ngram", "history", "eagle"),
        drafter=kind if kind in ("history", "eagle") else "ngram",
    )


def fail(problems: list[str]) -> None:
    """Raise one ValueError listing every problem (no-op when there is none)."""
    if problems:
        raise ValueError("invalid config:\n  - " + "\n  - ".join(problems))


def section(config: mlc.ConfigDict, name: str) -> object:
    """One section of `config` as its typed object (defaults where the config lacks the section); `spec`
    with SD on or off as `config.drafter.kind` says."""
    if name == "spec":
        kind = config.get("drafter", {}).get("kind", "none")
        return spec_for_kind(build_section(SpecConfig, config.get("spec", {}), "spec"), kind)
    return build_section(SECTIONS[name], config.get(name, {}), name)


def collect(
    config: mlc.ConfigDict, check_paths: bool = True, check_model: bool = True
) -> tuple[dict[str, object], list[str]]:
    """The sections of `config`'s job that build, by name ("run": the top-level keys), and every problem
    (unknown keys, each section's checks, the model's sources unless `check_model` is off (tools that
    build abstract models), the drafter's directories)."""
    job = config.get("job", "grpo")
    if job not in JOB_SCHEMA:  # the model's problems still reported: a config fails with all of them
        return {}, [f"config.job={job!r}: use one of {JOBS}."] + model_problems(config, check_paths)
    run_cls, names = JOB_SCHEMA[job]
    problems = unknown_key_problems(config, base_config(job), OPEN_SECTIONS)
    top = {f.name: config[f.name] for f in dataclasses.fields(run_cls) if f.name in config}
    built: dict[str, object] = {}
    for name in ("run", *names):
        try:
            if name == "run":
                built[name] = build_section(run_cls, top, "")
            elif name == "task":
                built[name] = plain_dict(config.get("task", {}))  # open: any nesting, plain data
            else:
                built[name] = section(config, name)
        except SectionError as e:
            problems += e.problems
    problems += model_problems(config, check_paths, text_jobs=True) if check_model else []
    if isinstance(built.get("drafter"), DrafterSection):
        problems += built["drafter"].path_problems() if check_paths else []
        problems += init_from_problems(config.drafter, check_paths)
    return built, problems


def parse(
    config: mlc.ConfigDict, check_paths: bool = True, check_model: bool = True
) -> GrpoConfig | WarmupConfig:
    """Every section of `config`'s job as its typed object, in one place; one ValueError listing every
    problem. `check_paths=False` skips the filesystem (cluster configs checked on a laptop). The GRPO job's
    checks across sections are `tlt_jax.rl.config.validate_grpo`'s."""
    built, problems = collect(config, check_paths, check_model)
    fail(problems)
    return (GrpoConfig if config.get("job", "grpo") == "grpo" else WarmupConfig)(raw=config, **built)
