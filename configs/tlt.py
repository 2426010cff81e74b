"""TLT: GRPO with speculative rollouts on a long-tail reasoning task (SmolLM2-135M on the 2-core CPU).

    python -m tlt_jax.main --config configs/tlt.py --workdir workdirs/tlt          # `make run`
    python -m tlt_jax.main --config configs/tlt.py:drafter=none --workdir w        # the plain baseline

The task: easy reasoning-gym chain_sum (2-3 terms, 1-2 digits) asked with the default step-by-step system
prompt and instruction, so most answers are short and a few ramble on: measured on 16 x 4 samples at T = 0.9
with a 384-token cap (experiments/paper/task_lengths.py): p50 60, p90 337 tokens, 8% at the cap, 6% correct,
20% with an `Answer:` line somewhere. gsm_symbolic gives a similar tail (p50 190, p90 384, 16% at the cap) but
~0 reward for this model, so nothing to learn in 10 steps. Reward: the verifier's score of the `Answer:` value
(or the last number) plus 0.5 when the response ENDS with its `Answer:` line (R1-style format reward). What 10
steps can teach a 135M model is the format; correctness does not move measurably in 10 x 32 samples. Measured
at lr 1e-4 (docs/journal/2026-11.md, "A reward that rises"): with a 0.2 bonus for an `Answer:` line anywhere,
the policy dropped its reasoning (mean length 108 -> 11 tokens, format 17% -> 2%: a bare "a + b = c" scores as
often as a derivation), removing the long tail TLT exists for; with 0.5 for a line anywhere it wrote the
marker early and rambled to the cap (held-out format 17% -> 91%, 69% of answers at the cap, accuracy 3% ->
0%). Hence the bonus only for an answer on the last line, as the instruction asks. 32 sequences per step (8
prompts x 4) put the rollout's end at 1-3 running rows, where speculation pays on this CPU (SD gains only at
batch 1-2 here; a GPU pays up to ~32).

The loss is Dr.GRPO's (advantage r - mean of the group, token sums over a constant 384): on this long-tail
task GRPO's per-sequence token mean penalises a long wrong answer's tokens less than a short one's, and at
lr 1e-4 over 8 x 4 samples the share of capped answers rose 6% -> 62% in 10 steps. At lr 2e-5 Dr.GRPO
moved nothing measurable in 10 steps (reward within a frozen-policy control's noise), hence lr 1e-4.

Learning is measured on a held-out set (config.eval: the task stream's last 32 problems, one sample each,
the same sampling keys every time, so an unchanged policy reproduces its samples): before training, after
step 5 and after step 10, logged as eval/* (the training reward/mean is on fresh prompts each step, and its
step-to-step spread for a frozen policy, 0.04-0.17, is larger than 10 steps of learning).

TLT's two halves are on by default: the spot trainer keeps the EAGLE drafter fresh on the rollouts' own
hidden states (one CPU device has no idle devices, so it trains between tail chunks and its cost shows in
`spot/added_seconds`), and BEG-MAB picks each chunk's mode among plain, two EAGLE chains and the n-gram
drafter per running-batch bucket (plain is an arm: it learns where speculation pays on this CPU).

Args (`configs/tlt.py:drafter=ngram,steps=10,seed=0`):
  drafter: auto (the warmed EAGLE drafter in `drafter_path` if present, else n-gram; the default), eagle,
           ngram, none
  drafter_path: the EAGLE warm-up workdir (default workdirs/drafter_tlt; create it with
           `python -m tlt_jax.main --config configs/drafter_warmup.py:tlt --workdir workdirs/drafter_tlt`)
  drafter_arch: eagle (EAGLE-1, the default) or eagle3 (EAGLE-3: the spot trainer's drafter, and a warmed one
           from `configs/drafter_warmup.py:tlt --config.arch=eagle3 --workdir DIR`, drafter_path=DIR)
  spot: between_chunks (default), idle_devices (needs --config.mesh.data >= 2), after_rollout, off
  bandit: beg_mab (default), egreedy, ucb1, sglang, threshold, fixed, off (SpecConfig's threshold switch)
  steps, seed, quick (3 steps of 4 prompts x 4: the e2e benchmark's --quick).
  data: a parquet / JSONL file (or glob) to train on instead of chain_sum, e.g. VeRL-layout problems written
           by `python -m tlt_jax.tasks.write_parquet --out data/chain_sum.parquet`; scored by math-verify,
           every task key (tlt_jax.tasks.datasets.task_config) overridable as --config.task.<key>=...
  eval_data: a benchmark file evaluated as config.eval.sets.bench (4 samples of its first 8 problems:
           mean@4, pass@k) before training, every eval.every steps (2 with quick) and at the end.
  dapo: DAPO's algorithm as VeRL's recipe runs it (config_lib.dapo_algorithm, configs/recipes/) at this
           CPU's size: clip 0.2 / 0.28, token-mean loss, no KL, dynamic sampling on the verdict (generation
           batches of the step's 4 prompts x 8 samples at T 1.0, up to 10), overlong shaping over the last
           64 of 384 tokens, rewards routed by data_source (write the file with `write_parquet --data-source
           math_dapo`); the optimizer stays this config's (lr 1e-4: 1e-6 moves nothing here). SmolLM2-135M
           answers few problems right, so a step keeps few varied groups: 8 samples per prompt (a group
           with one right answer in 8 is kept), and a step short of groups at max_num_gen_batches trains on
           those it kept (rl.train_short_steps; VeRL would stop with its error).
"""

from tlt_jax import config_lib, config_schema
from tlt_jax.models.loading import DEFAULT_GGUF_PATH, REPO_ROOT
from tlt_jax.tasks.datasets import task_config

# the task section, shared with the drafter warm-up (`configs/drafter_warmup.py:tlt`)
TASK = dict(
    kind="reasoning_gym",
    name="chain_sum",
    size=5000,
    seed=0,
    dataset_kwargs=dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2),
    answer_mode="answer_or_last_number",
    format_reward=0.5,
)
MAX_NEW_TOKENS = 384
TEMPERATURE = 0.9
DEFAULT_DRAFTER_PATH = str(REPO_ROOT / "workdirs" / "drafter_tlt")


def get_config(arg: str | None = None):
    arg = config_lib.parse_arg(
        arg,
        drafter="auto",
        steps=10,
        seed=0,
        drafter_path=DEFAULT_DRAFTER_PATH,
        spot="between_chunks",
        bandit="beg_mab",
        quick=False,
        runlocal=False,
        data="",
        eval_data="",
        dapo=False,
        drafter_arch="eagle",
    )
    c = config_schema.base_config()
    c.seed = arg.seed
    c.num_steps = 3 if arg.quick or arg.runlocal else arg.steps
    c.checkpoint_every = 4
    c.keep_checkpoints = 2

    c.model.path = str(DEFAULT_GGUF_PATH)
    c.model.dtype = "float32"  # this CPU has no bf16 instructions
    c.mesh.data, c.mesh.model = 1, 1  # one CPU device (fake devices would only split the same 2 cores)

    c.task = dict(TASK, seed=arg.seed)
    if arg.data:  # every key of the file task, so the command line can set any
        kind = "parquet" if arg.data.endswith(".parquet") else "jsonl"
        c.task = task_config(kind, path=arg.data, seed=arg.seed, reward="math_verify")

    c.rollout.temperature = TEMPERATURE
    c.rollout.max_new_tokens = MAX_NEW_TOKENS
    c.rollout.max_cache_len = 512
    c.rollout.chunk_steps = 16
    c.rollout.min_cache_bucket = 128
    c.rollout.prompt_bucket = 16

    c.drafter.kind = arg.drafter
    c.drafter.path = arg.drafter_path
    c.drafter.arch = arg.drafter_arch  # eagle3: EAGLE-3 (tlt_jax.models.eagle3) at SmolLM2's layers 2, 15, 27
    c.drafter.min_accept_len = 1.05  # n-gram drafts here accept ~1.2, a warmed EAGLE chain ~2.5
    # SD on once at most `threshold` rows run: on this CPU a verify round costs 1.1-1.6 decode steps at
    # batch 1-2 but several at batch 8 (docs/benchmarks.md), so SD pays only at the very end of the tail
    c.spec.strategy = "3_1_4"
    c.spec.threshold = 2
    c.spec.min_steps_below = 0
    c.spec.acceptance = "coupled"  # samples identical to plain decoding (see README)

    # the adaptive drafter: trained online between tail chunks (this CPU has one device), at most 8 updates
    # per rollout on 2 x 512-token packed micro-batches (~1.3 s each here)
    plain = arg.drafter == "none"  # the baseline: no drafter, no speculation, nothing to train or choose
    c.spot.mode = "off" if plain else arg.spot
    c.spot.threshold = 2
    c.spot.steps_per_chunk = 1
    c.spot.max_steps_per_rollout = 8
    c.spot.window = MAX_NEW_TOKENS
    c.spot.context = 128
    # the warm-up's final lr (1e-3 cosine-decayed to 1e-4), continuing from its AdamW moments (the learner
    # carries them over from the warm-up workdir's train_state/). Not tuned: a drafter trained from scratch
    # online (no warm-up) uses the same lr here
    c.spot.lr = 1e-4

    # the adaptive engine: BEG-MAB over plain, two EAGLE chains and the n-gram drafter, per running bucket
    c.bandit.algorithm = "off" if plain else arg.bandit
    c.bandit.arms = ("plain", "2_1_3", "3_1_4", "ngram_4_1_5")
    c.bandit.bucket_bounds = (1, 2, 4, 8)
    c.bandit.epsilon = 0.1
    c.bandit.window = 64

    c.rl.prompts_per_step = 4 if arg.quick else 8
    c.rl.samples_per_prompt = 4
    c.rl.advantage = "drgrpo"  # no division by the group's std
    c.rl.loss_agg = "seq_mean_token_sum_norm"  # a token's weight does not depend on its answer's length
    c.rl.kl_coef = 0.0
    c.rl.lr = 1e-4
    c.rl.weight_decay = 0.0
    c.rl.grad_clip = 1.0

    # the held-out eval: 32 rows like a training step (its compiled programs serve both)
    c.eval.every = 0 if arg.quick or arg.runlocal else 5  # --quick: the e2e benchmark's arms, no eval
    c.eval.prompts = 32
    c.eval.samples = 1
    if arg.eval_data:
        c.eval.sets = {"bench": dict(path=arg.eval_data, samples=4, max_prompts=8)}
        c.eval.every = c.eval.every or 2
        c.eval.prompts = c.eval.prompts if c.eval.every == 5 else 0  # quick: the set only, no held-out split

    if arg.dapo:
        c.rl.prompts_per_step = 4  # x 8 samples: 32 rows a batch, this CPU's rollout size
        config_lib.dapo_algorithm(c, samples=8, overlong_buffer=64, eval_samples=4)
        c.rl.gen_prompts_per_batch = c.rl.prompts_per_step
        c.rl.train_short_steps = True  # few groups vary at this size (docstring)

    c.trainer.micro_batch_size = 8
    c.trainer.train_layers = 10  # the top 10 of 30 layers: ~2x cheaper update on this CPU
    # prompts -> 128, responses -> 128 / 256 / 384 per micro-batch (sorted by length): at most 3 programs
    c.trainer.seq_bucket = 128
    return c
