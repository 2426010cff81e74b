"""Per-algorithm rules of the speculative-strategy selector (`beg_mab.py` holds the config, state and API).

Each rule is a pure jnp function of the static config, the selector state and the running bucket `b` (a
traced int32 scalar), so `beg_mab.select` / `beg_mab.update` stay one small jitted program per config:
- `bandit_arm`: BEG-MAB (median of trusted arms, plausible-only exploration; `_beg_mab_arm`), epsilon-greedy
  (mean) and sliding-window UCB1 over a bucket's eligible arms;
- `sglang_step`: mainline SGLang's per-bucket EMA of accepted drafts with hysteresis on a depth ladder.
(The "fixed" table needs no rule of its own: `beg_mab.select` indexes it. The paper's threshold switch is not
a selector rule: it is `hooks.ThresholdPolicy`, from `SpecConfig.threshold` / `min_steps_below`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.rollout.selector_config import SelectorConfig, SelectorState


def bandit_arm(cfg: SelectorConfig, state: SelectorState, b: jax.Array, key: jax.Array) -> jax.Array:
    """The arm a bandit plays next in bucket `b` (int32 scalar).

    beg_mab: `_beg_mab_arm`. egreedy (the textbook baseline): every eligible arm is played once first (lowest
    index first), then a uniform eligible arm with probability `epsilon`, else the highest MEAN of the arm's
    last `window` rewards. ucb1 exploits `mean / scale + ucb_c * sqrt(ln N / n)` over the bucket's last
    `window` plays (sliding-window UCB: an arm absent from that window counts as untried, so a changed arm is
    re-measured), `scale` being the largest reward in that window, which puts the bonus on the scale of
    rewards in [0, 1].
    """
    if cfg.algorithm == "beg_mab":
        return _beg_mab_arm(cfg, state, b, key)
    elig = jnp.asarray(cfg.eligible, bool)[b]  # [A]
    rew = state.rewards[b]  # [A, W], NaN = empty slot
    valid = ~jnp.isnan(rew)
    if cfg.algorithm == "ucb1":
        valid = valid & _fresh(cfg, state, b)
        n = valid.sum(-1)  # [A] plays of each arm among the bucket's last `window` plays
        untried = elig & (n == 0)
        mean = jnp.where(valid, rew, 0.0).sum(-1) / jnp.maximum(n, 1)
        scale = jnp.max(jnp.where(valid & elig[:, None], rew, -jnp.inf))
        scale = jnp.where(scale > 0, scale, 1.0)
        total = jnp.maximum(jnp.where(elig, n, 0).sum(), 1)
        bonus = cfg.ucb_c * jnp.sqrt(jnp.log(total.astype(jnp.float32)) / jnp.maximum(n, 1))
        score = mean / scale + bonus
        epsilon = 0.0
    else:
        untried = elig & (state.count[b] == 0)
        score = jnp.where(valid.any(-1), jnp.nanmean(rew, axis=-1), -jnp.inf)
        epsilon = cfg.epsilon
    greedy = jnp.argmax(jnp.where(elig, score, -jnp.inf))
    k_explore, k_arm = jax.random.split(key)
    uniform_arm = jax.random.categorical(k_arm, jnp.where(elig, 0.0, -jnp.inf))
    explore = jax.random.uniform(k_explore) < epsilon
    choice = jnp.where(explore, uniform_arm, greedy)
    return jnp.where(untried.any(), jnp.argmax(untried), choice).astype(jnp.int32)


def _fresh(cfg: SelectorConfig, state: SelectorState, b: jax.Array) -> jax.Array:
    """bool[A, W]: window entries written during bucket `b`'s last `window` plays (a time window)."""
    return state.stamps[b] > state.bucket_steps[b] - cfg.window


def _beg_mab_arm(cfg: SelectorConfig, state: SelectorState, b: jax.Array, key: jax.Array) -> jax.Array:
    """BEG-MAB: epsilon-greedy on the MEDIAN reward of each eligible arm over the bucket's last `window`
    plays, with three changes to the paper's rule, each for a failure measured in the case study:

    - Evidence before trust: an arm is ranked only once it has `min_plays` rewards in the window ("trusted");
      the median of one or two chunks is noise on a shared machine (a plain chunk slowed by another job made
      an SD arm look better and was never re-measured). "plain", the baseline, is always brought to
      `min_plays`; the other arms get one play and more only while plausible.
    - Exploration only among plausible arms: an arm whose BEST reward in the window is below the leader's
      median (the best median among trusted arms) is not explored. With plain an arm in every bucket, the
      paper's uniform exploration kept playing verify trees at 9-32 rows, where they run at half plain's
      speed: a tax of ~epsilon / 2 on every chunk there, forever. Plain stays plausible (it is never far
      from the best arm, and its median is what every other arm is judged against).
    - Staleness instead of forgetting by count: statistics use the bucket's last `window` plays (as UCB1
      does), so an arm left unplayed has no rewards after a while and is re-measured once: the best arm
      changing (the drafter learning online, the policy's text drifting) is found again. "A while" is
      `window` plays times how much slower the arm's last reward was than the leader's median, so re-probes
      of a verify tree at 4x plain's time (measured in `make run` at 9-32 rows: 5 re-probes made 35% of a
      step's decode time) come 4x less often: at most one chunk-time per `window` plays per dismissed arm.

    Order of play: arms that need plays (eligible, untrusted and plausible) first: plain, then the
    fewest plays, the lowest index on ties (a fresh bucket plays plain `min_plays` times, then every other
    arm once in index order, each judged against plain's median at once); then, with probability
    `epsilon`, a uniform plausible arm; else the leader.
    """
    elig = jnp.asarray(cfg.eligible, bool)[b]  # [A]
    rew = state.rewards[b]  # [A, W]
    valid = ~jnp.isnan(rew) & _fresh(cfg, state, b)
    n = valid.sum(-1)  # [A]
    masked = jnp.where(valid, rew, jnp.nan)
    median = jnp.nanmedian(masked, axis=-1)
    best = jnp.max(jnp.where(valid, rew, -jnp.inf), axis=-1)
    trusted = elig & (n >= cfg.min_plays)
    leader_score = jnp.where(trusted, median, -jnp.inf)
    lead = jnp.max(leader_score)  # -inf while nothing is trusted: every arm is plausible
    is_plain = jnp.asarray([t == 1 for t in cfg.tokens_to_verify], bool)
    # re-measure an arm with no reward in the window once `window x lead / its last reward` plays have passed
    # since its last play (never played: at once): a probe costs (lead / reward - 1) chunk-times, so each
    # dismissed arm taxes the bucket at most one chunk-time per `window` plays, however slow it was
    stamps = state.stamps[b]  # [A, W]
    last = jnp.argmax(stamps, axis=-1)  # [A] slot of each arm's newest entry
    last_stamp = jnp.take_along_axis(stamps, last[:, None], axis=-1)[:, 0]
    last_reward = jnp.take_along_axis(rew, last[:, None], axis=-1)[:, 0]
    slowdown = jnp.where(last_reward > 0, lead / jnp.maximum(last_reward, 1e-9), 1.0)
    due = (last_stamp < 0) | (state.bucket_steps[b] - last_stamp > cfg.window * jnp.maximum(slowdown, 1.0))
    plausible = elig & (((n == 0) & due) | (best >= lead) | is_plain)
    needs = ~trusted & plausible
    order = jnp.where(is_plain, -1, n)  # plain first (the reference), then the fewest plays, lowest index
    first_needed = jnp.argmin(jnp.where(needs, order, jnp.iinfo(jnp.int32).max))
    k_explore, k_arm = jax.random.split(key)
    uniform_arm = jax.random.categorical(k_arm, jnp.where(plausible, 0.0, -jnp.inf))
    explore = jax.random.uniform(k_explore) < cfg.epsilon
    choice = jnp.where(explore, uniform_arm, jnp.argmax(leader_score))
    return jnp.where(needs.any(), first_needed, choice).astype(jnp.int32)


def sglang_step(
    cfg: SelectorConfig, state: SelectorState, b: jax.Array, arm: jax.Array, accept_length: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Bucket `b`'s new (ema, rung, since_move) after a chunk of `arm` with `accept_length` tokens per round.

    The EMA (`sglang_alpha`) tracks accepted drafts per round, `accept_length - 1`, over speculative chunks
    only; NaN until the first one. Capacity of a rung = drafts a round can accept (`max_accept - 1`, 0 for
    plain). After at least `sglang_min_obs` updates since the last move, the bucket moves
    - one eligible rung deeper when ema > sglang_up * capacity of the current rung (drafts nearly fill it),
    - one eligible rung shallower when ema < sglang_down * capacity of that shallower rung (its drafts would
      not even fill it), or < sglang_plain_floor when the shallower rung is plain.
    With up > down the two thresholds leave a dead band (hysteresis): just after a move up, the way back
    needs the EMA to fall from above `up * c` to below `down * c`. On plain there is no acceptance to watch:
    after `sglang_probe_interval` updates (0 = never) it probes one rung deeper with a fresh EMA.
    """
    cap = jnp.asarray([m - 1 for m in cfg.ladder_max_accept], jnp.float32)  # [R]
    n_rungs = cap.shape[0]
    spec = jnp.asarray(cfg.tokens_to_verify, jnp.int32)[arm] > 1
    gain = accept_length - 1.0
    ema = state.ema[b]
    a = cfg.sglang_alpha
    ema = jnp.where(spec, jnp.where(jnp.isnan(ema), gain, (1 - a) * ema + a * gain), ema)
    since = state.since_move[b] + 1
    r = state.rung[b]
    elig = jnp.asarray(cfg.ladder_eligible, bool)[b]  # [R]
    idx = jnp.arange(n_rungs)
    up_r = jnp.min(jnp.where(elig & (idx > r), idx, n_rungs))
    dn_r = jnp.max(jnp.where(elig & (idx < r), idx, -1))
    cap_r, cap_dn = cap[r], cap[jnp.maximum(dn_r, 0)]
    on_plain = cap_r == 0
    ready = (since >= cfg.sglang_min_obs) & ~jnp.isnan(ema)
    probe = on_plain & (cfg.sglang_probe_interval > 0) & (since >= cfg.sglang_probe_interval)
    go_up = (up_r < n_rungs) & jnp.where(on_plain, probe, ready & (ema > cfg.sglang_up * cap_r))
    dn_thr = jnp.where(cap_dn > 0, cfg.sglang_down * cap_dn, cfg.sglang_plain_floor)
    go_dn = (dn_r >= 0) & ~on_plain & ready & (ema < dn_thr)
    new_r = jnp.where(go_dn, dn_r, jnp.where(go_up, up_r, r)).astype(jnp.int32)
    since = jnp.where(go_dn | go_up, 0, since).astype(jnp.int32)
    ema = jnp.where(go_up & on_plain, jnp.nan, ema).astype(jnp.float32)
    return ema, new_r, since
