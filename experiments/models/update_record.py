"""The Qwen2.5-7B update micro-step's memory plan on XLA:CPU, kept as JSON records (issue #45).

configs/qwen2_5_7b.py's trainer as the learner builds it (layers stored stacked and run as one `lax.scan`
with the prompt and response passes joined, remat nothing_saveable, chunked MLP and log-probs, FSDP),
compiled from abstract shapes (`tlt_jax.memory_plan.compile_update`; nothing materialised) in two layouts:
  config      the config's data x model = 2 x 4 mesh on 8 fake CPU devices, micro-batches of 8 rows: the
              plan the README quotes (51.6 GiB at 32K [H14], with the resident state outside the program);
  one_device  one device, one micro-batch of 2 samples of one prompt (`memory_plan.one_device_update`): the
              program the GPU suite's update_7b phase compiles and runs on one GPU, so XLA:GPU's plan and
              the measured peak can be set beside this plan of the same program.
Per program (update_accum: forward + backward over one part; logprobs: the old / reference log-prob
forward; update_apply: AdamW) the per-device bytes XLA reports (arguments, outputs, aliased outputs,
temporaries, code), plan = arguments + temporaries + outputs not aliased + code (what the program holds
while it runs), and need = plan + the resident state the program does not take (`memory_plan.update_table`'s
"need": the engine's weights and drafter, the reference, the spot trainer's drafter state, AdamW's moments
outside the apply).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.models.update_record
writes experiments/models/update_plans_7b.json: full depth (28 layers), 8,192 and 32,768 response tokens,
1,024-token prompts, both layouts.
    ... python -m experiments.models.update_record --two-layers
writes experiments/models/update_plan_2layers.json: the figures tests/experiments/test_memory_plans.py pins,
the config layout's update_accum at 2 layers at 8K, 16K and 32K under TEST_OPTIONS (and, beside them, under
the process's default options: what the fast code generator changes).
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jaxlib  # noqa: E402
import ml_collections as mlc  # noqa: E402

from experiments.lib import harness  # noqa: E402
from experiments.models.layer_fit import CONFIGS  # noqa: E402
from tlt_jax import config_lib  # noqa: E402
from tlt_jax import memory_plan as mpp  # noqa: E402
from tlt_jax.models.build import model_config_from  # noqa: E402
from tlt_jax.rollout.programs import ProgramInfo  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
FULL_RECORD = HERE / "update_plans_7b.json"
TWO_LAYER_RECORD = HERE / "update_plan_2layers.json"
PROMPT_LEN = 1024
FULL_LENS = (8192, 32768)
TWO_LAYER_LENS = (8192, 16384, 32768)
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters: the same HLO, buffer assignment and
# fusion decisions up to a few fusions (the plan within 0.4% of the default's at 2 layers: the record holds
# both), at a third of the compile's CPU time (2026-11-28: 4.6 against 12.1 s at 8K)
TEST_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
UPDATE_OUTSIDE = mpp.UPDATE_OUTSIDE


def layout_config(layout: str) -> mlc.ConfigDict:
    """configs/qwen2_5_7b.py with random-weight shapes, on its own mesh ("config") or on one device."""
    config = config_lib.load_config_file(CONFIGS["7b"])
    config.model.init = "random"
    return config if layout == "config" else mpp.one_device_update(config)


def program_row(layout: str, config: mlc.ConfigDict, layers: int, info: ProgramInfo, res: dict) -> dict:
    """One program's record: where and what it is, XLA's fields, plan and need (module docstring)."""
    outside = [k for k in UPDATE_OUTSIDE if not (info.key[0] == "update_apply" and k == "optimizer")]
    plan = info.argument_bytes + info.footprint_bytes
    return {
        "layout": layout,
        "mesh": {"data": int(config.mesh.data), "model": int(config.mesh.model)},
        "micro_batch_rows": int(config.trainer.micro_batch_size),
        "prompt_len": PROMPT_LEN,
        "response_len": int(info.key[1]) if len(info.key) > 1 else None,
        "layers": layers,
        "program": str(info.key[0]),
        "argument_bytes": info.argument_bytes,
        "output_bytes": info.output_bytes,
        "alias_bytes": info.alias_bytes,
        "temp_bytes": info.temp_bytes,
        "code_bytes": info.code_bytes,
        "plan_bytes": plan,
        "outside_bytes": sum(res[k] for k in outside),
        "need_bytes": plan + sum(res[k] for k in outside),
        "compile_s": round(info.compile_seconds, 1),
    }


def plan_rows(
    layout: str,
    lens: tuple[int, ...],
    layers: int | None = None,
    options: dict | None = None,
    full: bool = True,
) -> list[dict]:
    """The update's programs of `layout` at `layers` (None: the model's depth) for each response length:
    with `full` the accumulation, the log-prob forward and the optimizer's apply, else the accumulation."""
    config = layout_config(layout)
    mesh, cfg = config_lib.build_mesh(config), model_config_from(config)
    depth = layers or cfg.num_layers
    am = mpp.abstract_models(cfg, mesh, depth)
    res = mpp.resident(config, cfg.replace(num_layers=depth), mesh)
    infos = mpp.compile_update(config, am, mesh, PROMPT_LEN, 0, options=options) if full else []
    for nb in lens:
        infos += mpp.compile_update(config, am, mesh, PROMPT_LEN, nb, logprobs=full, options=options)
        print(f"  {layout}: {nb} tokens compiled ({infos[-1].compile_seconds:.0f} s)", flush=True)
    return [program_row(layout, config, depth, i, res) for i in infos]


def provenance(command: str, t0: float) -> dict[str, Any]:
    """What the figures depend on: jax / jaxlib, the backend and its flags, the commit, the date."""
    git = lambda *a: subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "command": command,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": f"{jax.device_count()} {jax.default_backend()} devices",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "commit": git("rev-parse", "--short", "HEAD"),
        "tree_clean": not git("status", "--porcelain", "--untracked-files=no"),
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, quick=None, out_help="the JSON to write (default: the record's file)")
    ap.add_argument("--two-layers", action="store_true", help="the test's figures (see above)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices", flush=True)
    cmd = "python -m experiments.models.update_record" + (" --two-layers" if args.two_layers else "")
    if args.two_layers:
        rows = plan_rows("config", TWO_LAYER_LENS, 2, TEST_OPTIONS, full=False)
        default = plan_rows("config", TWO_LAYER_LENS, 2, None, full=False)
        record = {
            "what": "configs/qwen2_5_7b.py's update_accum at 2 layers, 2 x 4 mesh (bytes per device)",
            "compiler_options": TEST_OPTIONS,
            "programs": rows,
            "default_options": default,
        }
        path = pathlib.Path(args.out or TWO_LAYER_RECORD)
    else:
        rows = [r for lay in ("config", "one_device") for r in plan_rows(lay, FULL_LENS)]
        record = {"what": "the 7B update's programs at full depth (bytes per device)", "programs": rows}
        path = pathlib.Path(args.out or FULL_RECORD)
    record = provenance(f"XLA_FLAGS=--xla_force_host_platform_device_count=8 {cmd}", t0) | record
    path.write_text(json.dumps(record, indent=1) + "\n")
    for r in rows:
        print(
            f"{r['layout']:<10} {r['program']:<12} {r['response_len'] or '':>6} {r['layers']:>3} layers: "
            f"plan {r['plan_bytes'] / 2**30:7.2f} GiB, need {r['need_bytes'] / 2**30:7.2f} GiB"
        )
    print(f"wrote {path} ({record['wall_s']:.0f} s)")
    config_rows = [r for r in rows if r["layout"] == "config" and r["program"] == "update_accum"]
    harness.result(
        {f"update_need_gib_{r['response_len']}": r["need_bytes"] / 2**30 for r in config_rows}, args, ".2f"
    )


if __name__ == "__main__":
    sys.exit(main())
