"""Plain-decode throughput: tlt_jax vs HF transformers (torch CPU) on the same SmolLM2 GGUF, side by side.

For each batch size, both generate the same number of greedy tokens (EOS ignored) after the same ~450-token
chat prompt; decode time excludes prefill (ours: the engine's decode phase; HF: generate(G) - generate(1)).
The batch-1 roofline is memory bandwidth (measured in this run: a jitted reduction over 1 GiB) divided by the
weight bytes one decode step reads. Final line: `RESULT key=value ...`.

    python experiments/bench_decode.py --quick      # batch 1 and 4, < 5 minutes on 2 cores
    python experiments/bench_decode.py              # batch 1, 4, 16, 64
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tlt_jax.models.llama import from_hf_tensors  # noqa: E402
from tlt_jax.models.loading import DEFAULT_GGUF_PATH, load_gguf  # noqa: E402
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine  # noqa: E402
from tlt_jax.rollout.sampling import SamplingParams  # noqa: E402

PASSAGE = (
    "Reinforcement learning for reasoning models spends most of each step sampling long answers. "
    "Response lengths have a long tail, so most devices wait for a few long sequences. "
)


def measure_bandwidth(gib: float = 1.0, reps: int = 10) -> float:
    """GB/s of a jitted float32 sum over `gib` GiB (reads each byte once; uses all cores)."""
    x = jnp.ones((int(gib * (1 << 30)) // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    del x
    return gib * (1 << 30) / best / 1e9


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


def hf_tok_s(hf, prompt: list[int], batch: int, new: int, reps: int) -> float:  # noqa: ANN001
    import torch

    ids = torch.tensor([prompt] * batch)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    run(2)  # warm-up
    best = 0.0
    for _ in range(reps):
        t_full, t_one = run(new), run(1)
        best = max(best, batch * (new - 1) / max(t_full - t_one, 1e-9))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4, fewer tokens (< 5 min)")
    ap.add_argument("--gguf", default=str(DEFAULT_GGUF_PATH))
    ap.add_argument("--prompt-len", type=int, default=448, help="context length at the start of decoding")
    ap.add_argument("--new", type=int, default=None, help="tokens generated per row")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,4,16,64")).split(",")]
    new = args.new or (32 if args.quick else 48)
    reps = 2 if args.quick else 3

    loaded = load_gguf(args.gguf)
    cfg = loaded.config
    model = from_hf_tensors(cfg, loaded.tensors)
    prompt = build_prompt(loaded.tokenizer, args.prompt_len)
    cache_len = 1 << int(np.ceil(np.log2(len(prompt) + new + 1)))
    engine = RolloutEngine(
        model, EngineConfig(max_new_tokens=new, max_cache_len=cache_len, chunk_steps=16), eos_ids=[]
    )
    weight_bytes = cfg.num_params() * jnp.dtype(cfg.dtype).itemsize
    bw = measure_bandwidth()
    roofline = bw * 1e9 / weight_bytes
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores; SmolLM2-135M fp32, "
        f"{weight_bytes / 1e6:.0f} MB of weights per step; bandwidth {bw:.1f} GB/s -> batch-1 roofline "
        f"{roofline:.1f} tok/s; context {len(prompt)}..{len(prompt) + new}"
    )

    hf = None
    if not args.no_hf:
        import torch
        import transformers

        gguf = pathlib.Path(args.gguf)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()

    results: dict[str, float] = {}
    print(f"{'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} {'ratio':>6}")
    for b in batches:
        ours = ours_tok_s(engine, prompt, b, new, reps)
        theirs = hf_tok_s(hf, prompt, b, new, reps) if hf is not None else float("nan")
        results[f"ours_tok_s_bs{b}"] = ours
        results[f"hf_tok_s_bs{b}"] = theirs
        results[f"ratio_vs_hf_bs{b}"] = ours / theirs if hf is not None else float("nan")
        print(f"{b:>5} {ours:>11.1f} {theirs:>9.1f} {results[f'ratio_vs_hf_bs{b}']:>6.2f}", flush=True)
    if 1 in batches:
        results["roofline_frac_bs1"] = results["ours_tok_s_bs1"] / roofline
    results["bandwidth_gb_s"] = bw
    keys = ["ours_tok_s_bs1", "hf_tok_s_bs1", "ratio_vs_hf_bs1", "roofline_frac_bs1"]
    keys += [k for k in results if k not in keys]
    print("RESULT " + " ".join(f"{k}={results[k]:.3f}" for k in keys if k in results))


if __name__ == "__main__":
    main()
