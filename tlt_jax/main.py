"""Entry point: `python -m tlt_jax.main --config configs/<name>.py[:arg] [--config.a.b=v ...] --workdir DIR`.

Resolves and validates the config, writes it to `DIR/config.json`, initialises JAX's distributed runtime when
`config.multiprocess` is true (the same code path runs on one host), and dispatches on `config.job`:
"grpo" -> `tlt_jax.rl.learner.run_grpo`, "drafter_warmup" -> `tlt_jax.drafter.warmup.run_warmup`.
Rerunning the same command with the same workdir resumes from the latest checkpoint.
"""

from __future__ import annotations

import json
import logging as logging_std
import os
import sys
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file: configs/<name>.py[:arg].", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl and config.json.")


def write_config(config: Any, workdir: str) -> str:
    """Write the resolved config (after command-line overrides) to `workdir/config.json` atomically."""
    from tlt_jax import config_lib
    from tlt_jax.utils.tracking import CONFIG_FILE

    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, CONFIG_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(config_lib.to_dict(config), f, indent=2, sort_keys=True, default=str)
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


def setup_jax(config: Any) -> None:
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


def validate_job(config: Any) -> None:
    """The job's validation: every problem of the config in one ValueError (GRPO checks its own sections)."""
    if config.job == "grpo":
        from tlt_jax.rl import config as rl_config

        rl_config.validate_grpo(config)
    else:
        from tlt_jax import config_lib

        config_lib.validate(config)


def run(config: Any, workdir: str) -> str:
    """Validate, record and run `config` in `workdir`; returns the job's status ("done" / "preempted")."""
    from tlt_jax import config_lib

    validate_job(config)
    setup_jax(config)
    import jax

    if jax.process_index() == 0:
        write_config(config, workdir)
    if config.job == "grpo":
        from tlt_jax.rl import learner

        return learner.run_grpo(config, workdir)
    if config.job == "drafter_warmup":
        from tlt_jax.drafter import warmup  # written separately; imported only for this job

        return warmup.run_warmup(config, workdir)
    raise ValueError(f"config.job={config.job!r}: use one of {config_lib.JOBS}.")


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
    try:
        validate_job(_CONFIG.value)
        from tlt_jax.utils import distributed  # the launch variables, read before anything starts

        if _CONFIG.value.multiprocess:
            distributed.resolve()
        else:
            distributed.check_single_process()
    except ValueError as e:  # a config mistake: say what and how to fix it, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    status = run(_CONFIG.value, _WORKDIR.value)
    logging.info("job %s: %s", _CONFIG.value.job, status)


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
    print(
        f"error: the command-line config is invalid: {message.strip()}\n"
        f"  config overrides given: {unknown or 'none'}\n"
        "  Overrides must name existing fields (--config.rl.lr=1e-5); see the config file, or config.json in "
        "a run's workdir, for the available keys.",
        file=sys.stderr,
    )
    sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
