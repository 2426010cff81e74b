"""Per-device memory plans of the paper's configs, compiled ahead of time from abstract shapes (issue #24).

For configs/qwen2_5_7b.py (Qwen2.5-7B; mesh data x model = 2 x 4 on 8 devices) and configs/qwen2_5_32b.py
(Qwen2.5-32B; 1 x 8, FSDP trainer) with `config.model.init=random` shapes, every program of a TLT RL step is
compiled for 8 fake CPU devices from `jax.ShapeDtypeStruct`s carrying the configs' shardings (nothing is
materialised; `memory_plan_programs.py`), and XLA's per-device accounting is reported:
  rollout  prefill of a step's prompts into its rows; the plain chunk after it; the plain chunk of the long
           tail (--tail-rows per data shard at the top cache bucket); the speculative chunks of the layouts of
           paper Table 5 at batch buckets --batches (rows per data shard), top cache bucket:
           single (one strategy), naive (one program per strategy), shared (one per tokens_to_verify) and
           bucketed (shared, and per bucket only the group BEG-MAB plays there: the paper's layout);
  update   the policy update's accumulation over one part (forward + backward), the log-prob forward (old /
           reference log-probs), at each --response-lens, and the optimizer's apply;
  drafter  one spot-trainer step of the EAGLE drafter (config.spot shapes).
Layers: each program is compiled with --layers (two small counts) and extrapolated linearly to the model's
(weights, caches and saved activations are per layer); speculative chunks take the per-layer slope of one
program per batch bucket (what grows per layer, the caches and weights, is the same for every strategy);
--check-layers compiles the slope programs once more and reports the fit's error.
Temporaries: XLA:CPU has no bfloat16 scatter, so it copies every layer's KV cache to float32 around the
cache write (+2x the cache per layer, a CPU-only artefact); so every program is also compiled in float32,
where no copy is made but every float buffer is 4 bytes. The GPU estimate is a range: high = the smaller
temporary of the two (both bound the bfloat16 GPU program's buffers from above), low = half the float32 one
(every float buffer at 2 bytes; scores, logits and optimizer math stay float32 on a GPU, so it is lower).
Arguments, outputs and aliasing are the bfloat16 program's, as XLA reports them. Attention is the jnp
reference (materialised scores); --pallas-probe compiles the tail with the kernel.
Peaks add the resident state a program does not take as arguments (exact, from the abstract shardings at full
depth): during the rollout the trainer's float32 masters, AdamW moments, reference weights and the drafter's
train state; during the update the engine's weights. Every layout is the one the learner builds: the trainer
comes from `rl.config.abstract_policy_trainer` (AdamW moments sharded like the params they track).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.models.memory_plans [--quick]
--responses 8192,16384,32768 [--compile-times]: instead, the paper's update (configs/qwen2_5_7b.py, or the
first of --configs, 1,024-token prompts) compiled at full depth (layers scanned: no extrapolation) per
response length, with the resident state (`memory_plan.update_plan`; RESULT <program>_gib=..
fits_72gib=yes|no), and the update's compile time scanned vs unrolled at 7 and 28 layers (at the first
length). `update_record.py` keeps that plan (8K, 32K; the config's mesh and one device) as JSON records.
--rollout [--insert-rows 8,64]: instead, the paper's rollout at the config's running-rows cap
(experiments/models/rollout_plan.py; RESULT <program>_gib=.. fits_72gib=..).
Final line: `RESULT gib_<layout>_<cfg>=.. peak_<phase>_<cfg>=.. fits_<cfg>=0|1|uncertain ..
layer_fit_err_of_need=.. layer_fit_err_of_field=.. wall_s=..`; the raw accounting in --out/measured_*.json.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.sharding import AbstractMesh, AxisType  # noqa: E402

from experiments.lib import harness as h  # noqa: E402
from experiments.lib.program_layouts import ALL_LAYOUTS, layout_programs, layout_totals  # noqa: E402
from experiments.models.layer_fit import CONFIGS, Spec, estimate, extrapolate, fit_errors  # noqa: E402
from tlt_jax import config_lib, config_schema  # noqa: E402
from tlt_jax import memory_plan as mpp  # noqa: E402
from tlt_jax.models.build import model_config_from  # noqa: E402
from tlt_jax.rl import config as rl_config  # noqa: E402
from tlt_jax.rollout.programs import ProgramInfo  # noqa: E402

# one strategy per BEG-MAB bucket (bs 1 -> 48, 2-4 -> 32, 5-20 -> 16, >= 21 -> 8 tokens to verify), as the
# paper's Table 5 setting (naive 30.39 = 3.9 x single 7.81 GB: about four strategies)
PAPER_STRATEGIES = ",".join(config_lib.PAPER_STRATEGIES)
PAPER_GB = {"single": 7.81, "naive": 30.39, "bucketed": 10.69}  # Table 5, CUDA-graph memory (GB)
DEVICE_GIB = 78.0  # what JAX sees of an 80 GB H100 (docs: "about 78 GiB")
GIB = 2**30
PHASES = ("rollout", "update", "drafter")
# resident state outside each kind of program's arguments (see `resident`)
OUTSIDE = {
    "rollout": ("masters", "optimizer", "reference", "drafter_state"),
    "update": ("optimizer", "engine_params", "engine_drafter", "reference", "drafter_state"),
    "update_apply": ("engine_params", "engine_drafter", "reference", "drafter_state"),
    "drafter": ("masters", "optimizer", "reference", "engine_rest", "engine_drafter"),
}


def program_specs(config: Any, engines: dict[str, Any], args: argparse.Namespace) -> list[Spec]:
    """Every program of the plan (see the module docstring), rollout first."""
    base = engines["naive"]
    n, prompts = int(config.rl.samples_per_prompt), int(config.rl.prompts_per_step)
    rows, data = base.batch_bucket(prompts * n), base.data_size
    top = args.sd_cache or base.cache_bucket(base.config.max_cache_len)
    first = mpp.prefill_cache_bucket(base, args.prompt_len)
    own = lambda key, phase: Spec(key, phase, key)  # noqa: E731
    specs = [
        own(("prefill", rows, first, prompts, args.prompt_len), "rollout"),
        own(("chunk", rows, first, 1, ()), "rollout"),
        own(("chunk", args.tail_rows * data, top, 1, ()), "rollout"),
    ]
    chunks: dict[tuple, Spec] = {}
    reps: dict[int, tuple] = {}
    for layout in ALL_LAYOUTS:
        eng = engines[layout]
        for b, mode in layout_programs(eng, layout, args.batches):
            tv = eng.modes[mode].strategy.tokens_to_verify
            key = ("chunk", b * data, top, tv, eng.mode_group(mode))
            old = chunks.get(key)
            layouts = (old.layouts if old else ()) + (layout,)
            chunks[key] = Spec(key, "rollout", reps.setdefault(b, key), layouts, mode)
    specs += list(chunks.values())
    for nb in args.response_lens:
        specs += [own(("update_accum", nb), "update"), own(("logprobs", nb), "update")]
    apply = Spec(("update_apply",), "update_apply", ("update_apply",))
    return specs + [apply, Spec(("drafter_step",), "drafter", ())]


class Compiler:
    """Compiles specs at one (dtype, depth): abstract models, cached abstract states, the layout engines."""

    def __init__(self, config: Any, engines: dict, mesh: Any, cfg: Any, args: argparse.Namespace) -> None:
        self.config, self.engines, self.mesh, self.args = config, engines, mesh, args
        self.am = mpp.abstract_models(cfg, mesh)
        self.sp = config_lib.sampling_from(config)
        self._states: dict[tuple, Any] = {}
        self._update: dict[tuple, ProgramInfo] = {}

    def state(self, rows: int, cache: int) -> Any:
        if (rows, cache) not in self._states:
            eng, plen = self.engines["naive"], self.args.prompt_len
            self._states[rows, cache] = mpp.abstract_state(eng, self.am, self.sp, rows, cache, plen)
        return self._states[rows, cache]

    def __call__(self, spec: Spec) -> ProgramInfo:
        kind, key = spec.key[0], spec.key
        if kind == "prefill":
            info = mpp.compile_prefill(self.engines["naive"], self.am, self.sp, key[1], key[3], key[4])
        elif kind == "chunk":
            eng = self.engines[spec.layouts[0] if spec.layouts else "naive"]
            info = mpp.compile_chunk(eng, self.am, self.sp, self.state(key[1], key[2]), spec.mode)
        elif kind == "drafter_step":
            info = mpp.compile_drafter_step(self.config, self.am, self.mesh)
        else:
            if key not in self._update:
                nb, plen = (0 if kind == "update_apply" else key[1]), self.args.prompt_len
                for i in mpp.compile_update(self.config, self.am, self.mesh, plen, nb):
                    self._update[i.key if nb else key] = i
            info = self._update[key]
        return dataclasses.replace(info, key=key)


def plan_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Compile, extrapolate and account one config's programs (see the module docstring)."""
    config = config_lib.load_config_file(CONFIGS[name])
    config.model.init = "random"
    mesh, cfg = config_lib.build_mesh(config), model_config_from(config)
    engines = {k: mpp.stand_in_engine(k, config, mesh, args.strategies, args.single) for k in ALL_LAYOUTS}
    specs = program_specs(config, engines, args)
    (l1, l2), check = args.layers, args.check_layers
    depths = [l1, l2] + ([check] if check else [])
    measured: dict[tuple[str, int], dict] = {}
    t0 = time.perf_counter()
    for dtype in ("bfloat16", "float32"):
        for depth in depths:
            comp = Compiler(config, engines, mesh, cfg.replace(dtype=dtype, num_layers=depth), args)
            todo = specs if depth == l1 else [s for s in specs if s.rep == s.key]
            measured[dtype, depth] = {s.key: comp(s) for s in todo}
            print(
                f"  {name}: {len(todo)} programs compiled in {dtype} at {depth} layers "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    full = {
        dt: extrapolate(specs, measured[dt, l1], measured[dt, l2], l1, l2, cfg.num_layers)
        for dt in ("bfloat16", "float32")
    }
    est = {k: estimate(full["bfloat16"][k], full["float32"][k]) for k in full["bfloat16"]}
    err = None
    if check:  # worst first, over both dtypes
        err = sorted(
            (
                e + (dt,)
                for dt in ("bfloat16", "float32")
                for e in fit_errors(specs, {d: measured[dt, d] for d in depths}, (l1, l2, check))
            ),
            key=lambda e: e[:2],
            reverse=True,
        )
    mpp.dump(name, pathlib.Path(args.out), measured)
    probe = pallas_probe(name, mesh, cfg, specs[2], args) if args.pallas_probe else None
    return dict(
        name=name,
        config=config,
        mesh=mesh,
        cfg=cfg,
        specs=specs,
        full=full,
        est=est,
        err=err,
        check=check,
        res=mpp.resident(config, cfg, mesh),
        compile_s=time.perf_counter() - t0,
        probe=probe,
    )


def pallas_probe(name: str, mesh: Any, cfg: Any, tail: Spec, args: argparse.Namespace) -> tuple[int, int]:
    """(temp bytes of the long tail's plain chunk with the Pallas kernel (interpret mode), with the jnp
    reference), float32, --layers[0] layers: what attn_impl=auto (Pallas on GPUs) costs under the mesh."""
    out = []
    for impl in ("pallas", "reference"):
        c = config_lib.load_config_file(CONFIGS[name])
        c.rollout.attn_impl = impl
        engines = {"naive": mpp.stand_in_engine("naive", c, mesh, args.strategies, args.single)}
        comp = Compiler(c, engines, mesh, cfg.replace(dtype="float32", num_layers=args.layers[0]), args)
        out.append(comp(tail).temp_bytes)
    return out[0], out[1]


def peaks(plan: dict[str, Any], end: str = "high") -> dict[str, tuple[int, tuple]]:
    """Per phase: (the largest per-device need, its program) at one end of the estimate: arguments +
    footprint + the resident state outside the program's arguments (OUTSIDE)."""
    out: dict[str, tuple[int, tuple]] = {}
    for s in plan["specs"]:
        info = plan["est"][s.key][end]
        need = info.argument_bytes + info.footprint_bytes + sum(plan["res"][k] for k in OUTSIDE[s.phase])
        phase = "update" if s.phase == "update_apply" else s.phase
        if need > out.get(phase, (-1, ()))[0]:
            out[phase] = (need, s.key)
    return out


def layout_infos(plan: dict[str, Any], end: str = "high") -> dict[str, list[ProgramInfo]]:
    """The speculative chunk programs of each layout (paper Table 5), at one end of the estimate."""
    return {lay: [plan["est"][s.key][end] for s in plan["specs"] if lay in s.layouts] for lay in ALL_LAYOUTS}


def verdict(plan: dict[str, Any]) -> str:
    """The plan on one device: "fits" when every phase's high estimate fits, "does not fit" when a low one
    does not, else "uncertain"."""
    if max(v[0] for v in peaks(plan, "high").values()) <= DEVICE_GIB * GIB:
        return "fits"
    low = max(v[0] for v in peaks(plan, "low").values())
    return "does not fit" if low > DEVICE_GIB * GIB else "uncertain"


def print_plan(plan: dict[str, Any]) -> None:
    """The tables of one config: programs, layouts (paper Table 5), resident state, phase peaks, meshes."""
    cfg, mesh, g = plan["cfg"], plan["mesh"], lambda b: f"{b / GIB:7.2f}"  # noqa: E731
    print(
        f"\n== {plan['name']}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_params() / 1e9:.2f}B params, mesh {dict(mesh.shape)}; GiB per device "
        f"(XLA:CPU, extrapolated from {plan['layers']} layers)"
    )
    print(
        f"{'program':<50} {'args':>7} {'out':>7} {'tmpbf16':>7} {'tmpf32':>7} {'fp low':>7} {'fp high':>7} "
        f"{'need':>7}"
    )
    for s in plan["specs"]:
        b, f, e = plan["full"]["bfloat16"][s.key], plan["full"]["float32"][s.key], plan["est"][s.key]
        print(
            f"{mpp.label(s.key):<50.50} {g(b.argument_bytes)} {g(max(b.output_bytes - b.alias_bytes, 0))} "
            f"{g(b.temp_bytes)} {g(f.temp_bytes)} {g(e['low'].footprint_bytes)} "
            f"{g(e['high'].footprint_bytes)} {g(b.argument_bytes + e['high'].footprint_bytes)}"
        )
    lo, hi = layout_totals(layout_infos(plan, "low")), layout_totals(layout_infos(plan, "high"))
    print(f"\n{'layout':>9} {'programs':>8} {'sum GiB (low-high)':>19} {'max GiB':>8} {'paper GB':>9}")
    for lay, t in hi.items():
        sums = f"{lo[lay]['bytes'] / GIB:.2f}-{t['bytes'] / GIB:.2f}"
        print(
            f"{lay:>9} {t['programs']:>8} {sums:>19} {t['peak_bytes'] / GIB:8.2f} {PAPER_GB.get(lay, '-'):>9}"
        )
    if plan["err"]:
        l1, l2 = plan["layers"]
        print(f"\nlayer fit ({l1}, {l2}) checked at {plan['check']} layers, worst of each measure:")
        worst = {
            "of the program's need": max(plan["err"]),
            "of the field": max(plan["err"], key=lambda e: e[1]),
        }
        for what, (of_need, of_field, key, field, dt) in worst.items():
            print(
                f"  {what}: {mpp.label(key)} {field} ({dt}): {of_need:.1%} of the program's need, "
                f"{of_field:.1%} of the field"
            )
    print("\nresident per device (GiB): " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan["res"].items()))
    low = peaks(plan, "low")
    for phase, (need, key) in peaks(plan, "high").items():
        print(f"peak {phase:<8} {low[phase][0] / GIB:6.2f}-{need / GIB:6.2f} GiB ({mpp.label(key)})")
    print(f"verdict on a {DEVICE_GIB:.0f} GiB device (80 GB H100): {verdict(plan)}")
    if plan["probe"]:
        pal, ref = plan["probe"]
        print(
            f"attention probe (plain tail chunk, f32, {plan['layers'][0]} layers): temporaries "
            f"{pal / GIB:.2f} GiB with the Pallas kernel (interpret mode) vs {ref / GIB:.2f} GiB with the "
            "jnp reference"
        )
    print("resident state per device on other meshes (data x model: GiB): " + mesh_floors(plan))


def mesh_floors(plan: dict[str, Any]) -> str:
    """The resident state per device (what must fit before any program runs) on meshes with 1-8 data
    shards at the config's model axis (AbstractMesh: no devices needed)."""
    model, out = plan["mesh"].shape["model"], []
    for data in (1, 2, 4, 8):
        am = AbstractMesh((data, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        tot = sum(v for k, v in mpp.resident(plan["config"], plan["cfg"], am).items() if k != "engine_rest")
        out.append(f"{data}x{model} {tot / GIB:.1f}")
    return "; ".join(out)


def plot(plans: list[dict[str, Any]], path: pathlib.Path) -> pathlib.Path:
    """Per config: the layouts' summed footprints (paper Table 5 beside) and the phase peaks vs a device."""
    plt = h.pyplot()

    fig, axes = plt.subplots(len(plans), 2, figsize=(11, 3.8 * len(plans)), squeeze=False)
    for row, plan in zip(axes, plans, strict=True):
        totals = layout_totals(layout_infos(plan))
        x = list(totals)
        bars = row[0].bar(x, [totals[k]["bytes"] / GIB for k in x], color="#2ca02c", label="this plan (GiB)")
        row[0].bar_label(bars, fmt="%.2f")
        row[0].scatter(
            [k for k in x if k in PAPER_GB],
            [PAPER_GB[k] for k in x if k in PAPER_GB],
            color="k",
            marker="_",
            s=600,
            label="paper Table 5 (GB)",
        )
        row[0].set_title(f"{plan['name']}: SD chunk programs, summed footprint / device", fontsize=10)
        row[0].legend(fontsize=8)
        x = list(range(len(PHASES)))
        hi, lo = peaks(plan, "high"), peaks(plan, "low")
        row[1].bar(x, [hi[k][0] / GIB for k in PHASES], 0.6, color="#1f77b4", alpha=0.45, label="high")
        row[1].bar(x, [lo[k][0] / GIB for k in PHASES], 0.6, color="#1f77b4", label="low")
        row[1].set_xticks(x, PHASES)
        row[1].set_yscale("log")
        row[1].axhline(DEVICE_GIB, color="k", ls="--", label=f"device ({DEVICE_GIB:.0f} GiB)")
        row[1].set_title(
            f"{plan['name']}: peak GiB / device by phase, mesh {dict(plan['mesh'].shape)}", fontsize=10
        )
        row[1].legend(fontsize=7)
    return h.save_plot(fig, path, dpi=100)


def parse_args() -> argparse.Namespace:
    ap = h.parser(
        __doc__,
        quick="layers 1,2, buckets 1,2, two strategies, Nb 1024, no check",
        out=h.ROOT / "workdirs" / "memory_plans",
    )
    ap.add_argument("--configs", default="7b,32b", help=f"comma-separated of {sorted(CONFIGS)}")
    ap.add_argument("--layers", default=None, help="two small layer counts to fit on (2,4)")
    ap.add_argument("--check-layers", type=int, default=None, help="a third count to check the fit (0: off)")
    ap.add_argument("--strategies", default=None, help=f"EAGLE strategies (default {PAPER_STRATEGIES})")
    ap.add_argument("--single", default="4_4_16", help="the single layout's strategy")
    ap.add_argument("--batches", default=None, help="rows per data shard of the SD buckets (1,2,4,8,16,32)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt bucket (tokens)")
    ap.add_argument("--response-lens", default=None, help="update response lengths (512,1024,4096,32768)")
    ap.add_argument(
        "--tail-rows", type=int, default=32, help="rows per shard of the long tail (SD threshold)"
    )
    ap.add_argument("--sd-cache", type=int, default=0, help="cache bucket of SD chunks (0: the top one)")
    ap.add_argument("--pallas-probe", type=int, default=None, help="compile the tail with the kernel (1/0)")
    ap.add_argument("--responses", default="", help="the update at full depth at these lengths (see top)")
    ap.add_argument("--compile-times", action="store_true", help="with --responses: scanned vs unrolled")
    ap.add_argument("--micro-batch", type=int, default=0, help="trainer.micro_batch_size (0: the config's)")
    ap.add_argument("--seq-parallel", action="store_true", help="trainer.seq_parallel (with --responses)")
    from experiments.models import rollout_plan  # --rollout: the paper's rollout (issue 36)

    rollout_plan.add_args(ap)
    a = ap.parse_args()
    q = a.quick
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    a.layers = ints(a.layers or ("1,2" if q else "2,4"))
    a.check_layers = (0 if q else 6) if a.check_layers is None else a.check_layers
    a.strategies = (a.strategies or ("8_4_48,4_4_16" if q else PAPER_STRATEGIES)).split(",")
    a.batches = ints(a.batches or ("1,2" if q else "1,2,4,8,16,32"))
    a.response_lens = ints(a.response_lens or ("1024" if q else "512,1024,4096,32768"))
    a.pallas_probe = (not q) if a.pallas_probe is None else bool(a.pallas_probe)
    a.configs = [c.strip() for c in a.configs.split(",")]
    if len(a.layers) != 2 or a.layers[0] >= a.layers[1] or a.single not in a.strategies:
        sys.exit("--layers needs two increasing counts and --single one of --strategies")
    return a


def update_main(args: argparse.Namespace, t0: float) -> None:
    """The paper's update at full depth (see the module docstring): table, compile times, RESULT. The config
    is the first of --configs (7b by default; 32b wants 16 devices: its mesh is data x 8)."""
    config = config_lib.load_config_file(CONFIGS[args.configs[0]])
    config.model.init = "random"
    if args.micro_batch:
        config.trainer.micro_batch_size = args.micro_batch
    if args.seq_parallel:
        config.trainer.seq_parallel = True
    config_schema.fail(rl_config.rl_problems(config))  # e.g. a micro-batch that splits a group, not 0 rows
    nbs, mesh, tc = [int(x) for x in args.responses.split(",")], config_lib.build_mesh(config), config.trainer
    print(f"mesh {dict(mesh.shape)}; trainer {tc.to_dict()}", flush=True)
    infos, res = mpp.update_plan(config, mesh, 1024, nbs)
    lines, out = mpp.update_table(infos, res, 72.0)
    print("\n".join(lines))
    if args.compile_times:
        for layers in (7, 28):
            for scan in (True, False):
                sec = mpp.update_compile_seconds(config, mesh, 1024, nbs[0], layers, scan)
                what = "scanned" if scan else "unrolled"
                print(f"compile update_accum {nbs[0]} at {layers} layers, {what}: {sec:.1f} s", flush=True)
                out[f"compile_s_{what}_{layers}"] = round(sec, 1)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    h.result(out, args, fmt="")


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices; {vars(args)}",
        flush=True,
    )
    if args.responses:
        return update_main(args, t0)
    if args.rollout:
        from experiments.models import rollout_plan

        return rollout_plan.main(args, t0)
    plans = []
    for name in args.configs:
        plan = plan_config(name, args)
        plan["layers"] = tuple(args.layers)
        print_plan(plan)
        plans.append(plan)
    out = h.out_dir(args)
    png = plot(plans, out / "memory_plans.png")
    res: dict[str, Any] = {}
    for plan in plans:
        n = plan["name"]
        for lay, t in layout_totals(layout_infos(plan)).items():
            res[f"gib_{lay}_{n}"] = round(t["bytes"] / GIB, 3)
        lo = peaks(plan, "low")
        for phase, (need, _) in peaks(plan, "high").items():
            res[f"peak_{phase}_{n}"] = f"{lo[phase][0] / GIB:.1f}-{need / GIB:.1f}"
        res[f"fits_{n}"] = {"fits": 1, "does not fit": 0}.get(verdict(plan), "uncertain")
    errs = [p["err"][0] for p in plans if p["err"]]
    res["layer_fit_err_of_need"] = round(max(e[0] for e in errs), 4) if errs else "nan"
    res["layer_fit_err_of_field"] = round(max(e[1] for e in errs), 4) if errs else "nan"
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"\nplot: {png}; wall {res['wall_s']:.0f} s")
    h.result(res, args, fmt="")


if __name__ == "__main__":
    main()
