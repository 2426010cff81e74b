"""Entry point: `python -m tlt_jax.main --config configs/<name>.py[:arg] [--config.a.b=v ...] --workdir DIR`.

Resolves and validates the config, writes it to `DIR/config.json`, initialises JAX's distributed runtime when
`config.multiprocess` is true (the same code path runs on one host), and dispatches on `config.job`:
"grpo" -> `tlt_jax.rl.learner.run_grpo`, "drafter_warmup" -> `tlt_jax.drafter.warmup.run_warmup`.
Rerunning the same command with the same workdir resumes from the latest checkpoint.

Exit status (`exit_status`): 0 the run finished; 75 it stopped on SIGTERM/SIGINT at an agreed point with its
checkpoints consistent (requeue to resume); 70 the watchdog ended a stalled process; 2 a config error;
anything else a failure.
"""

from __future__ import annotations

import json
import logging as logging_std
import os
import pathlib
import sys
from typing import TYPE_CHECKING

import ml_collections as mlc
from absl import app, flags, logging
from ml_collections import config_flags

from tlt_jax.utils.config_checks import ALLOW_CHANGE_FLAG, check_workdir_config, override_hints
from tlt_jax.utils.plain import plain_dict

if TYPE_CHECKING:  # the job modules import jax: main imports them after setting it up
    from tlt_jax.config_schema import GrpoConfig, WarmupConfig

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file: configs/<name>.py[:arg].", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl and config.json.")
_ALLOW_CHANGE = flags.DEFINE_bool(
    ALLOW_CHANGE_FLAG, False, "Resume a workdir whose config.json differs from this config (changes logged)."
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run",
    False,
    "Validate the config and the workdir, print the mesh over the visible devices (N fake CPU devices with "
    "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=N) and exit; nothing is written.",
)


def write_config(config: mlc.ConfigDict, workdir: str) -> str:
    """Write the resolved config (after command-line overrides) to `workdir/config.json` atomically."""
    from tlt_jax.utils.tracking import CONFIG_FILE

    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(plain_dict(config), f, indent=2, sort_keys=True, default=str)
    os.replace(path + ".tmp", path)
    return path


class _QuietLibraries(logging_std.Filter):
    """Drop INFO/DEBUG records from chatty libraries (orbax logs every file it writes); keep warnings."""

    NOISY = ("/orbax/", "/jax/_src/")

    def filter(self, record: logging_std.LogRecord) -> bool:
        return record.levelno >= logging_std.WARNING or not any(n in record.pathname for n in self.NOISY)


def quiet_libraries() -> None:
    """Install `_QuietLibraries` on absl's handler (idempotent)."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
        handler.addFilter(_QuietLibraries())


class ConsoleFormatter(logging_std.Formatter):
    """INFO and below as the bare message: a person reads the step line, not the logger's prefix. WARNING and
    above keep absl's full record (level, date, time, thread, file:line): where a problem came from. absl
    writes no log file unless a program asks it to (this one does not), so the console is the whole log."""

    def __init__(self) -> None:
        super().__init__("%(message)s")
        self.full = logging.PythonFormatter()

    def format(self, record: logging_std.LogRecord) -> str:
        return self.full.format(record) if record.levelno >= logging_std.WARNING else super().format(record)


def plain_console() -> None:
    """Format absl's handler with `ConsoleFormatter` (under `app.run`, before the job logs anything)."""
    logging.get_absl_handler().setFormatter(ConsoleFormatter())


def _steps_in(folder: pathlib.Path) -> str:
    """The newest steps of a folder of `<step>` (checkpoints) or `step_<step>` (exports) entries."""
    names = (p.name.removeprefix("step_") for p in folder.iterdir())
    steps = sorted(int(n) for n in names if n.isdigit())
    return f" (steps {', '.join(map(str, steps[-4:]))})" if steps else " (none yet)"


def _wandb_row(config: mlc.ConfigDict, wd: pathlib.Path) -> str | None:
    """Where the run's wandb data is (and how to upload an offline run), or why there is none."""
    from tlt_jax.utils.tracking import WANDB_ID_FILE, resolve_wandb_mode

    section = config.get("wandb") or {}
    try:
        mode = resolve_wandb_mode(section.get("mode"), os.environ)
    except ValueError as e:
        return f"unknown mode: {e}"
    if mode == "disabled":
        return "off (config.wandb.mode or WANDB_MODE is disabled)"
    run_id = (wd / WANDB_ID_FILE).read_text().strip() if (wd / WANDB_ID_FILE).exists() else ""
    runs = sorted((wd / "wandb").glob(f"*run-*-{run_id}")) if run_id else []
    if not runs:
        return None
    if mode == "offline":
        return f"{runs[-1]} (offline; upload it with `wandb sync {runs[-1]}`)"
    return f"{runs[-1]} ({mode}, project {section.get('project') or 'tlt_jax'}, run id {run_id})"


def run_summary(config: mlc.ConfigDict, workdir: str, status: str) -> str:
    """The end of a job: its status, then where its outputs are (metrics, samples, checkpoints, the plot,
    wandb, the config); a line for each that exists."""
    from tlt_jax.utils.run_plots import PLOT_DIR, PLOT_FILE
    from tlt_jax.utils.tracking import CONFIG_FILE, METRICS_FILE, read_metrics

    wd = pathlib.Path(workdir)
    rows: list[tuple[str, str]] = []
    if (wd / METRICS_FILE).exists():
        steps = {r["step"] for r in read_metrics(wd / METRICS_FILE)}
        rows.append(("metrics", f"{wd / METRICS_FILE} ({len(steps)} logged steps)"))
    if (wd / "samples.jsonl").exists():
        rows.append(("samples", str(wd / "samples.jsonl")))
    for name in ("checkpoints", "drafter", "train_state", "exports"):
        if (wd / name).is_dir():
            rows.append((name, f"{wd / name}{_steps_in(wd / name)}"))
    if (wd / PLOT_DIR / PLOT_FILE).exists():
        rows.append(("plot", str(wd / PLOT_DIR / PLOT_FILE)))
    wandb = _wandb_row(config, wd) if config.job == "grpo" else None
    if wandb:
        rows.append(("wandb", wandb))
    rows.append(("config", str(wd / CONFIG_FILE)))
    tail = "; rerun the same command to resume" if status != "done" else ""
    return "\n".join([f"job {config.job}: {status}{tail}"] + [f"  {k:<12} {v}" for k, v in rows])


def setup_jax(config: mlc.ConfigDict) -> None:
    """Process-level JAX setup that must happen before any device is touched: the persistent compilation
    cache, and with `config.multiprocess` JAX's distributed runtime (tlt_jax.utils.distributed: coordinator,
    process count and id from TLT_JAX_* or SLURM's variables; a clear ValueError when none are set)."""
    import jax

    from tlt_jax.utils import compile_stats, distributed

    folder = compile_stats.resolve_cache_dir(str(config.get("compilation_cache_dir", "auto")))
    if folder:
        compile_stats.enable_persistent_cache(folder)
        logging.info("persistent compilation cache: %s", folder)
    if config.multiprocess:  # every process runs this same program; the mesh spans all their devices
        spec = distributed.initialize()
        logging.info(
            "jax.distributed: process %d of %d (coordinator %s; %s): %d local / %d global devices",
            jax.process_index(),
            jax.process_count(),
            spec.coordinator,
            spec.source,
            jax.local_device_count(),
            jax.device_count(),
        )
    else:
        distributed.check_single_process()


def validate_job(config: mlc.ConfigDict) -> GrpoConfig | WarmupConfig:
    """The job's config, every section typed and checked once: every problem in one ValueError (the GRPO
    job adds its checks across sections)."""
    if config.get("job", "grpo") == "grpo":
        from tlt_jax.rl import config as rl_config

        return rl_config.validate_grpo(config)
    from tlt_jax import config_schema

    return config_schema.parse(config)


def run(config: mlc.ConfigDict, workdir: str, allow_config_change: bool = False) -> str:
    """Validate, record and run `config` in `workdir`; returns the job's status ("done" / "preempted"). A
    workdir whose config.json differs from `config` is refused unless `allow_config_change`."""
    from tlt_jax import config_lib

    job = validate_job(config)
    changes = check_workdir_config(config, workdir, allow_config_change)
    if changes:
        logging.warning("resuming %s with a changed config:\n  %s", workdir, "\n  ".join(changes))
    setup_jax(config)
    import jax

    config_lib.build_mesh(config)  # a mesh that does not fit the devices fails before the workdir is written
    if jax.process_index() == 0:
        write_config(config, workdir)
    if config.job == "grpo":
        from tlt_jax.rl import learner

        return learner.run_grpo(job, workdir)
    if config.job == "drafter_warmup":
        from tlt_jax.drafter import warmup  # written separately; imported only for this job
        from tlt_jax.utils.run_plots import refresh_plot

        status = warmup.run_warmup(job, workdir)
        if jax.process_index() == 0:  # the GRPO learner draws its own plot as it goes
            refresh_plot(workdir)
        return status
    raise ValueError(f"config.job={config.job!r}: use one of ('grpo', 'drafter_warmup').")


def dry_run(config: mlc.ConfigDict, workdir: str) -> str:
    """What a launch would build, without starting it: the (data, model) mesh `config.mesh` resolves to on
    this process's visible devices (`config_lib.build_mesh`, the run's own code) and whether `workdir`
    resumes. One process, no distributed runtime: configs/cluster/slurm_grpo.sh's DRY_RUN=1 shows a
    cluster's mesh on as many fake CPU devices."""
    import jax

    from tlt_jax import config_lib

    mesh = config_lib.build_mesh(config)
    data, model = mesh.shape["data"], mesh.shape["model"]
    resume = "resumes its checkpoints" if (pathlib.Path(workdir) / "checkpoints").is_dir() else "starts anew"
    return (
        f"dry run: job {config.job}, mesh data={data} x model={model} over {data * model} of "
        f"{jax.device_count()} {jax.default_backend()} devices; workdir {workdir} {resume}"
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(
            f"unexpected positional arguments {argv[1:]}: options are --config and --workdir."
        )
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config configs/default.py")
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required, e.g. --workdir workdirs/default")
    quiet_libraries()
    plain_console()
    try:
        validate_job(_CONFIG.value)
        check_workdir_config(_CONFIG.value, _WORKDIR.value, _ALLOW_CHANGE.value)
        from tlt_jax.utils import distributed  # the launch variables, read before anything starts

        if _DRY_RUN.value:
            print(dry_run(_CONFIG.value, _WORKDIR.value), flush=True)
            return
        if _CONFIG.value.multiprocess:
            distributed.resolve()
        else:
            distributed.check_single_process()
    except ValueError as e:  # a config mistake: say what and how to fix it, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        status = run(_CONFIG.value, _WORKDIR.value, _ALLOW_CHANGE.value)
    except Exception as e:  # several processes: a peer's death shows here as a failed collective
        import jax

        from tlt_jax.sharding import MeshError

        if isinstance(e, MeshError):  # checked before anything is written: a config mistake
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        hint = distributed.peer_failure_message(e, jax.process_index(), jax.process_count())
        if hint:
            print(f"error: {hint}", file=sys.stderr, flush=True)
        raise
    import jax

    if jax.process_index() == 0:
        logging.info("%s", run_summary(_CONFIG.value, _WORKDIR.value, status))
    else:
        logging.info("job %s: %s", _CONFIG.value.job, status)
    code = exit_status(status)
    if code:
        sys.exit(code)


def exit_status(status: str) -> int:
    """The process's exit status for a job's end: 0 "done" (every step run); EXIT_STOPPED (75, sysexits'
    EX_TEMPFAIL) "preempted" (stopped on a request at a point every process agreed on, checkpoints
    consistent: requeue or rerun to resume; every process of the run returns it). The other statuses: 2 a
    config error, EXIT_STALLED (70) the watchdog, anything else a failure (tlt_jax.utils.watchdog)."""
    from tlt_jax.utils.watchdog import EXIT_STOPPED

    codes = {"done": 0, "preempted": EXIT_STOPPED}
    if status not in codes:
        raise ValueError(f"unknown job status {status!r}: expected one of {sorted(codes)}")
    return codes[status]


def _file_config(argv: list[str]) -> mlc.ConfigDict | None:
    """The config of the `--config` file without the overrides (None when it does not load): what a
    mistyped override's nearest keys come from."""
    from tlt_jax import config_lib

    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--config=") else None
        if a == "--config" and i + 1 < len(argv):
            value = argv[i + 1]
        if value:
            path, _, arg = value.partition(":")
            try:
                return config_lib.load_config_file(path, arg or None)
            except Exception:  # a broken config file has its own error: no hints then
                return None
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that turns config errors (unknown keys, bad values, bad config args) into one clear
    message and exit status 2 instead of a traceback from inside ml_collections."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        message = str(e)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        inner: BaseException = e
        while inner.args and isinstance(inner.args[0], BaseException):  # AttributeError(KeyError(...))
            inner = inner.args[0]
        text = str(inner.args[0]) if inner.args else str(inner)
        kind = "unknown config key" if isinstance(e, (AttributeError, KeyError)) else type(e).__name__
        message = f"{kind}: " + "; ".join(line.strip() for line in text.splitlines() if line.strip())
    unknown = [a for a in argv[1:] if a.startswith("--config.")]
    hints = override_hints(flags.FLAGS["config"].value or _file_config(argv), unknown) if unknown else []
    print(
        f"error: the command-line config is invalid: {message.strip()}\n"
        + "".join(f"  {h}\n" for h in hints)
        + f"  config overrides given: {unknown or 'none'}\n"
        "  Overrides must name existing fields (--config.rl.lr=1e-5); see the config file, or config.json in "
        "a run's workdir, for the available keys.",
        file=sys.stderr,
    )
    sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
