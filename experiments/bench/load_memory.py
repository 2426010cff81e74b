"""Peak host memory and wall time of loading a HF safetensors checkpoint: placed straight onto the devices
(`sharded_loading.place_hf_params`, the default) vs the all-float32 path (`load_hf_dir` + `from_hf_tensors`).

    python -m experiments.bench.load_memory --arch qwen2_5_1_5b              # both ways
    python -m experiments.bench.load_memory --arch qwen2_5_7b --ways new     # old: ~64 GB (1.5B x 4.9)

Writes a random-weight bf16 checkpoint of the architecture's exact shapes (`tlt_jax.models.presets`) to
`--dir` (default `.cache/bench_load/<arch>`, reused when complete): config.json, a byte tokenizer, shards of
at most `--shard-gb` with model.safetensors.index.json, written tensor by tensor. Each way then loads it in
its own process (model dtype bfloat16, the paper's rollout dtype) on `--devices` fake CPU devices (a 1 x N
mesh, the parameters split over the model axis) and reports its peak resident set (`ru_maxrss`), its
resident set before loading (imports), the placed parameters' bytes and the wall time. On a CPU the
devices' memory IS host memory: `extra_gb` = peak - before - params is what the loader itself cost beyond
the model it built. `--delete` removes the checkpoint afterwards.

Final line: `RESULT arch=.. params_gb=.. new_peak_rss_gb=.. new_extra_gb=.. new_wall_s=.. [old_...]`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from experiments.lib import harness
from tlt_jax.models import presets
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.loading import expected_shapes
from tlt_jax.models.safetensors_io import write_index, write_safetensors
from tlt_jax.models.tokenizer import ByteTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
GB = 1e9
DONE = "WRITTEN"  # marker file: the checkpoint in --dir is complete


def hf_config(cfg: ModelConfig) -> dict[str, object]:
    """config.json of a Qwen2ForCausalLM with the shapes of `cfg`."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": "bfloat16",
    }


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bf16 of magnitude 2^-7..2^-6 and random sign, from random bits (fast: no float sampling)."""
    n = int(np.prod(shape, dtype=np.int64))
    bits = np.frombuffer(rng.bytes(2 * n), np.uint16) & np.uint16(0x807F) | np.uint16(0x3C00)
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


def write_checkpoint(cfg: ModelConfig, d: pathlib.Path, shard_gb: float, seed: int = 0) -> None:
    """A random-weight bf16 HF checkpoint of `cfg`'s shapes in `d`, written one tensor at a time."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    ByteTokenizer().save(d)
    shapes = expected_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * 2
        if shards[-1] and size + nbytes > shard_gb * GB:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    rng = np.random.default_rng(seed)
    files = []
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        spec = {n: (shapes[n], np.dtype(ml_dtypes.bfloat16)) for n in names}
        write_safetensors(d / fname, spec, lambda n: random_bf16(shapes[n], rng))
        files.append((fname, names))
        print(f"wrote {fname}: {len(names)} tensors", flush=True)
    total = sum(int(np.prod(s, dtype=np.int64)) * 2 for s in shapes.values())
    write_index(d, files, total)
    (d / DONE).write_text("ok\n")


def _rss_gb() -> float:
    """Current resident set (VmRSS) in GB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / GB
    return float("nan")


def child(way: str, d: pathlib.Path, model_axis: int) -> None:
    """Load `d` one way and print `CHILD key=value ...` (runs in its own process: its peak is its own)."""
    import jax
    from flax import nnx

    from tlt_jax import sharding as shd
    from tlt_jax.models.llama import from_hf_tensors
    from tlt_jax.models.loading import load_hf_dir, open_hf_dir
    from tlt_jax.models.sharded_loading import place_hf_params

    mesh = shd.make_mesh(data=1, model=model_axis)
    shard_fn = lambda params: shd.param_shardings(params, mesh)  # noqa: E731
    before = _rss_gb()
    t0 = time.perf_counter()
    if way == "new":
        ckpt = open_hf_dir(d, dtype="bfloat16")
        model = place_hf_params(ckpt.config, ckpt.source, shard_fn)
    else:  # the float32 path: every tensor on the host as float32, fused, then placed
        loaded = load_hf_dir(d, dtype="bfloat16")
        model = from_hf_tensors(loaded.config, loaded.tensors)
        del loaded
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.device_put(state, shard_fn(state)))
    params = nnx.state(model, nnx.Param)
    jax.block_until_ready(params)
    wall = time.perf_counter() - t0
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
    print(
        f"CHILD way={way} wall_s={wall:.1f} peak_rss_gb={peak:.2f} before_gb={before:.2f} "
        f"params_gb={nbytes / GB:.2f} extra_gb={peak - before - nbytes / GB:.2f}",
        flush=True,
    )


def run_child(way: str, d: pathlib.Path, devices: int) -> dict[str, str]:
    """One `child` process; its CHILD line as a dict (a child killed for memory reports rc and nothing)."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "experiments.bench.load_memory", "--child", way, "--dir", str(d)]
    cmd += ["--devices", str(devices)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
    if proc.returncode or not lines:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        return {"rc": str(proc.returncode)}
    print(lines[-1], flush=True)
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, quick=None)
    p.add_argument("--arch", default="qwen2_5_1_5b", choices=sorted(presets.ARCHS))
    p.add_argument("--dir", type=pathlib.Path, default=None)
    p.add_argument("--ways", default="new,old", help="comma-separated: new, old")
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices (a 1 x N mesh)")
    p.add_argument("--shard-gb", type=float, default=4.0)
    p.add_argument("--delete", action="store_true", help="remove the checkpoint afterwards")
    p.add_argument("--child", choices=("new", "old"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    d = args.dir or ROOT / ".cache" / "bench_load" / args.arch
    if args.child:
        return child(args.child, d, args.devices)
    cfg = presets.arch_config(args.arch)
    if not (d / DONE).is_file():
        t0 = time.perf_counter()
        write_checkpoint(cfg, d, args.shard_gb)
        print(f"wrote {cfg.num_params() * 2 / GB:.2f} GB to {d} in {time.perf_counter() - t0:.0f} s")
    gb = f"{cfg.num_params() * 2 / GB:.2f}"
    result = {"arch": args.arch, "devices": str(args.devices), "params_gb": gb}
    for way in args.ways.split(","):
        out = run_child(way, d, args.devices)
        result.update({f"{way}_{k}": v for k, v in out.items() if k not in ("way", "params_gb")})
    if args.delete:
        shutil.rmtree(d)
    harness.result(result, args, fmt="")


if __name__ == "__main__":
    main()
