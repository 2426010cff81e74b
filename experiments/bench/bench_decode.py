"""Plain-decode throughput: tlt_jax vs HF transformers on the same SmolLM2 GGUF and device, side by side.

For each batch size, both generate the same number of greedy tokens (EOS ignored) after the same ~450-token
chat prompt; decode time excludes prefill (ours: the engine's decode phase; HF: generate(G) - generate(1)).
HF runs on the same device as JAX (torch CUDA on a GPU, with a synchronize around each timing; CPU
otherwise), in the same dtype (`--dtype`), on two paths: `generate` with its default dynamic KV cache (HF's
slowest path: every step runs eager PyTorch), and HF's fast path, a static KV cache
(`cache_implementation="static"`) whose decode step `generate` compiles with `torch.compile` (its
`CompileConfig`: inductor, mode "reduce-overhead", i.e. CUDA graphs); the fast path's warm-up (compilation and
graph capture, reported as `hf_fast_warmup_s`) is excluded from its timing. transformers compiles the decode
step only on CUDA/XPU and inductor's CPU build of even a tiny model takes minutes on 2 cores, so on a CPU the
fast path is skipped with that reason (`--hf-fast on` forces it there). The batch-1 roofline is memory
bandwidth (measured in this run: on CPU a jitted reduction over 1 GiB; on a GPU a jitted copy-like pass over
1 GiB, bytes read + written) divided by the weight bytes one decode step reads; `roofline_kv_frac_bs{B}`
also counts the B rows' KV-cache reads at the mean context. Final line: `RESULT key=value ...`; `--json FILE`
also writes every row as it completes (a run cut short keeps its finished batches).

    python -m experiments.bench.bench_decode --quick      # batch 1 and 4, < 5 minutes on 2 cores
    python -m experiments.bench.bench_decode              # batch 1, 4, 16, 64
    python -m experiments.bench.bench_decode --dtype bfloat16 --batches 1,4,16,64 --json decode.json   # a GPU
    python -m experiments.bench.bench_decode --tiny --new 4  # tiny random model (+ same weights in HF): smoke
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import harness as h
from tlt_jax.models.config import ModelConfig, tiny_config
from tlt_jax.models.llama import Transformer, from_hf_tensors
from tlt_jax.models.loading import expected_shapes
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.interface import EngineConfig
from tlt_jax.rollout.sampling import SamplingParams

PASSAGE = (
    "Reinforcement learning for reasoning models spends most of each step sampling long answers. "
    "Response lengths have a long tail, so most devices wait for a few long sequences. "
)


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def measure_bandwidth(gib: float = 1.0, reps: int = 10) -> float:
    """Device memory GB/s, best of `reps`. CPU: a jitted float32 sum over `gib` GiB (reads each byte once;
    uses all cores). GPU: a jitted `x + 1` over `gib` GiB, counting the bytes read and written (a device
    copy: what a GPU's memory system sustains; one reduction launch cannot keep every SM busy enough)."""
    x = jnp.ones((int(gib * (1 << 30)) // 4,), jnp.float32)
    gpu = on_gpu()
    f = jax.jit(lambda a: a + 1.0) if gpu else jax.jit(jnp.sum)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    del x
    return (2 if gpu else 1) * gib * (1 << 30) / best / 1e9


def build_prompt(tok, target_len: int) -> list[int]:  # noqa: ANN001
    text = PASSAGE
    while len(tok.encode_chat([{"role": "user", "content": text + "Summarise this."}])) < target_len:
        text += PASSAGE
    return tok.encode_chat([{"role": "user", "content": text + "Summarise this."}])[:target_len]


def ours_tok_s(engine: RolloutEngine, prompt: list[int], batch: int, new: int, reps: int) -> float:
    sp = SamplingParams(temperature=0.0)
    engine.generate([prompt] * batch, n=1, key=jax.random.key(0), sampling=sp, max_new_tokens=new)  # warm-up
    best = 0.0
    for r in range(reps):
        out = engine.generate([prompt] * batch, n=1, key=jax.random.key(r), sampling=sp, max_new_tokens=new)
        decoded = int(out.lengths.sum()) - batch  # the first token of each row comes from prefill
        best = max(best, decoded / out.stats.phase_seconds["decode"])
    return best


def hf_tok_s(
    hf,  # noqa: ANN001
    prompt: list[int],
    batch: int,
    new: int,
    reps: int,
    fast: bool = False,
) -> tuple[float, float]:
    """HF `generate` decode tokens/s (best of `reps` of generate(new) - generate(1)) and the warm-up seconds.
    fast: HF's fast path, a static cache whose decode step `generate` compiles (torch.compile through its
    CompileConfig; on a CPU only if forced, see the module docstring); the warm-up runs two full generations,
    so compilation and CUDA-graph capture happen before any timing."""
    import torch

    ids = torch.tensor([prompt] * batch, device=hf.device)
    kw: dict[str, Any] = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if fast:
        from transformers import CompileConfig

        cuda = hf.device.type == "cuda"
        cc = CompileConfig(mode="reduce-overhead" if cuda else "default")
        cc._compile_all_devices = not cuda or None  # transformers' own switch to compile off CUDA (testing)
        kw.update(cache_implementation="static", compile_config=cc)
    sync = torch.cuda.synchronize if hf.device.type == "cuda" else (lambda: None)

    def run(n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        return time.perf_counter() - t

    warm = sum(run(n) for n in ((new, new) if fast else (2,)))
    if fast and not hasattr(hf, "_compiled_call"):
        raise RuntimeError(
            "transformers did not compile the static-cache decode step (its auto-compile rules)"
        )
    best = float("nan")
    for _ in range(reps):
        t_full, t_one = run(new), run(1)
        if t_full > t_one:  # timing noise can exceed a tiny model's decode time: such a rep says nothing
            best = max(x for x in (best, batch * (new - 1) / (t_full - t_one)) if x == x)
    return best, warm


def tiny_models(dtype: str, with_hf: bool) -> tuple[ModelConfig, Transformer, Any]:
    """A tiny random Llama (2 layers) for smoke runs, and the same weights as an HF model (or None)."""
    cfg = tiny_config(vocab_size=256, dtype=dtype)
    if not with_hf:
        rng = np.random.default_rng(0)
        tensors = {
            k: 0.05 * rng.standard_normal(v, dtype=np.float32) for k, v in expected_shapes(cfg).items()
        }
        return cfg, from_hf_tensors(cfg, tensors), None
    import torch
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=4096,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    tensors = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    return cfg, from_hf_tensors(cfg, tensors), hf


def parse_args() -> argparse.Namespace:
    ap = h.parser(__doc__, quick="batch 1 and 4, fewer tokens (< 5 min)", out=None)
    h.add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=448, help="context length at the start of decoding")
    ap.add_argument("--new", type=int, default=None, help="tokens generated per row")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument(
        "--hf-fast",
        default="auto",
        choices=["auto", "on", "off"],
        help="HF's static cache + torch.compile path (auto: CUDA only; on: also on a CPU, slow to compile)",
    )
    ap.add_argument("--hf-fast-batches", default="", help="batch sizes of the fast path (default: all)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="ours and HF's")
    ap.add_argument("--attn-impl", default="auto", help="EngineConfig.attn_impl (auto: Pallas on a GPU)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of the GGUF (smoke)")
    return ap.parse_args()


def load_hf(args: argparse.Namespace, hf: Any) -> Any:
    """The HF model on the device JAX uses, in --dtype (loaded from the GGUF unless the tiny one is given)."""
    import torch
    import transformers

    if hf is None:
        gguf = pathlib.Path(args.gguf)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, args.dtype)
        ).eval()
    hf = hf.to(
        device="cuda" if on_gpu() and torch.cuda.is_available() else "cpu", dtype=getattr(torch, args.dtype)
    )
    print(f"HF transformers {transformers.__version__} on {hf.device} ({args.dtype})")
    return hf


def fast_path_plan(args: argparse.Namespace, hf: Any, batches: list[int]) -> tuple[list[int], str]:
    """(the batches HF's fast path runs at, why it does not run at all: '' when it does)."""
    if hf is None:
        return [], "no HF baseline (--no-hf or transformers missing)"
    if args.hf_fast == "off":
        return [], "--hf-fast off"
    if args.hf_fast == "auto" and hf.device.type != "cuda":
        return [], (
            "skipped on CPU: transformers compiles the static-cache decode step only on CUDA/XPU, and "
            "inductor's CPU build takes minutes here (--hf-fast on forces it)"
        )
    chosen = [int(b) for b in args.hf_fast_batches.split(",") if b] or batches
    return [b for b in batches if b in chosen], ""


def main() -> None:
    args = parse_args()
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,4,16,64")).split(",")]
    new = args.new or (32 if args.quick else 48)
    reps = 2 if args.quick else 3

    hf = None
    if args.tiny:
        cfg, model, hf = tiny_models(args.dtype, with_hf=not args.no_hf)
        prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, size=args.prompt_len).tolist()
        name = "tiny random Llama"
    else:
        loaded, model = h.load_target(args.gguf, dtype=args.dtype)
        cfg = loaded.config
        prompt = build_prompt(loaded.tokenizer, args.prompt_len)
        name = "SmolLM2-135M"
    cache_len = 1 << int(np.ceil(np.log2(len(prompt) + new + 1)))
    engine = RolloutEngine(
        model,
        EngineConfig(max_new_tokens=new, max_cache_len=cache_len, chunk_steps=16, attn_impl=args.attn_impl),
        eos_ids=[],
    )
    itemsize = jnp.dtype(cfg.dtype).itemsize
    weight_bytes = cfg.num_params() * itemsize
    # KV-cache bytes one row reads per step at the mean context of the run (all layers, K and V)
    kv_row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (len(prompt) + new / 2) * itemsize
    bw = measure_bandwidth(1.0 / 16 if args.tiny else 1.0)
    roofline = bw * 1e9 / weight_bytes
    device = jax.devices()[0]
    print(
        f"{h.device_line(kind=True)}; {name} "
        f"{args.dtype}, attn {args.attn_impl}, {weight_bytes / 1e6:.0f} MB of weights per step; bandwidth "
        f"{bw:.1f} GB/s -> batch-1 roofline {roofline:.1f} tok/s; context {len(prompt)}..{len(prompt) + new}"
    )
    if not args.no_hf:
        hf = load_hf(args, hf)
    fast_batches, fast_skip = fast_path_plan(args, hf, batches)
    if fast_skip:
        print(f"HF fast path (static cache + torch.compile): {fast_skip}")
    meta = {
        "model": name,
        "dtype": args.dtype,
        "attn_impl": args.attn_impl,
        "jax": jax.__version__,
        "platform": device.platform,
        "device": device.device_kind,
        "bandwidth_gb_s": bw,
        "weight_bytes": weight_bytes,
        "kv_row_bytes": kv_row_bytes,
        "context": [len(prompt), len(prompt) + new],
        "new_tokens": new,
        "hf_device": str(hf.device) if hf is not None else None,
        "hf_fast": fast_skip or f"static cache + torch.compile at batches {fast_batches}",
    }
    bench = (engine, hf, prompt, new, reps, bw, weight_bytes, kv_row_bytes)
    results = measure_all(bench, batches, fast_batches, meta, h.json_path(args))
    if 1 in batches:
        results["roofline_frac_bs1"] = results["ours_tok_s_bs1"] / roofline
    results["bandwidth_gb_s"] = bw
    keys = ["ours_tok_s_bs1", "hf_tok_s_bs1", "hf_fast_tok_s_bs1", "ratio_vs_hf_bs1", "ratio_vs_hf_fast_bs1"]
    keys.append("roofline_frac_bs1")
    keys += [k for k in results if k not in keys]
    h.result({k: results[k] for k in keys if k in results}, args)  # --json: merged beside the rows


def measure_all(
    bench: tuple,
    batches: list[int],
    fast_batches: list[int],
    meta: dict[str, Any],
    json_path: pathlib.Path | None,
) -> dict[str, float]:
    """Per batch: ours, HF dynamic cache, HF fast path (where planned); a row printed and (with --json) the
    file rewritten after every batch, so a run stopped midway keeps what finished."""
    engine, hf, prompt, new, reps, bw, weight_bytes, kv_row_bytes = bench
    nan = float("nan")
    results: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'hf fast':>9} {'ratio':>6} {'vs fast':>7}")
    for b in batches:
        ours = ours_tok_s(engine, prompt, b, new, reps)
        theirs = hf_tok_s(hf, prompt, b, new, reps)[0] if hf is not None else nan
        fast, warm, fast_error = nan, nan, ""
        if b in fast_batches:
            try:  # a fast path that breaks is a finding to report, not the end of the benchmark
                fast, warm = hf_tok_s(hf, prompt, b, new, reps, fast=True)
            except Exception as e:
                fast_error = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"HF fast path at batch {b} failed: {fast_error}", flush=True)
        bound = b * bw * 1e9 / (weight_bytes + b * kv_row_bytes)  # tok/s if every step streamed at bw
        results |= {f"ours_tok_s_bs{b}": ours, f"hf_tok_s_bs{b}": theirs, f"ratio_vs_hf_bs{b}": ours / theirs}
        if b in fast_batches:
            results |= {f"hf_fast_tok_s_bs{b}": fast, f"ratio_vs_hf_fast_bs{b}": ours / fast}
            results[f"hf_fast_warmup_s_bs{b}"] = warm
        results[f"roofline_kv_frac_bs{b}"] = ours / bound
        print(
            f"{b:>5} {ours:>11.1f} {theirs:>9.1f} {fast:>9.1f} {ours / theirs:>6.2f} {ours / fast:>7.2f}",
            flush=True,
        )
        row = {"batch": b, "ours_tok_s": ours, "hf_tok_s": theirs, "hf_fast_tok_s": fast}
        row |= {"hf_fast_warmup_s": warm, "roofline_tok_s": bound, "roofline_frac": ours / bound}
        rows.append(row | ({"hf_fast_error": fast_error} if fast_error else {}))
        if json_path:
            json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return results


if __name__ == "__main__":
    main()
