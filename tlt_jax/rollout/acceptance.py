"""Lossless acceptance rules for speculative decoding: which drafted tokens the target keeps, and the bonus.

RL needs rollouts whose tokens are distributed exactly as the target policy samples them (GRPO's importance
ratios and KL terms assume it), so speculative decoding may only change *speed*, never the distribution. Each
rule here takes the target's sampling distribution `p` as produced by `sampling.target_probs` (temperature,
top-k, top-p already applied), so plain decoding and speculative decoding sample the very same `p`.

Four rules:

* `tree_accept_coupled` (the default): verification coupled to plain sampling: each node's draw is the one
  plain decoding makes with the same key, so a speculative round emits the tokens 1-token steps would emit.
* `tree_accept`: target-only tree sampling (SGLang's `tree_speculative_sampling_target_only`, used by TLT). It
  needs no draft probabilities, so it works for any drafter and any tree shape.
* `tree_accept_greedy`: the temperature-0 special case (argmax matching); `tree_accept` on one-hot `p` gives
  the identical result.
* `chain_accept_rejection`: Leviathan et al. / Chen et al. speculative sampling for a chain of drafts
  whose full draft distributions `q` are known.

Tree layout (static shapes per strategy): `N` verify nodes per row; node 0 is the root (the last committed
token, not a draft); nodes 1..N-1 are drafted tokens in topological order (`parents[i] < i`); siblings are
ordered by draft preference = index order; padding nodes have parent -2 and are never anyone's child.
`target_probs_bnv[b, i]` is the target's distribution for the token that follows node `i`.

Padding convention of the outputs: -1 everywhere a slot holds no node / no token.
"""

from __future__ import annotations

import chex
import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.rollout.sampling import categorical

PAD = -1  # value of unused slots in `path` and `tokens`


@flax.struct.dataclass
class TreeAcceptance:
    """Result of verifying one draft tree per row.

    num_accepted: [B] int32, drafted nodes accepted (the root is not counted); 0..max_depth.
    path: [B, max_depth+1] int32 node indices: the root (0), then the accepted nodes in depth order, then -1.
    tokens: [B, max_depth+1] int32 emitted tokens: the accepted drafted tokens, then the bonus token at index
        `num_accepted`, then -1. Every row emits `num_accepted + 1` tokens.
    bonus: [B] int32, the token sampled from the last accepted node's (residual) distribution.
    last_node: [B] int32, the last accepted node (= path[b, num_accepted]); decoding continues from it.
    """

    num_accepted: jax.Array
    path: jax.Array
    tokens: jax.Array
    bonus: jax.Array
    last_node: jax.Array


@flax.struct.dataclass
class ChainAcceptance:
    """Result of verifying a chain of k drafts per row.

    num_accepted: [B] int32, accepted drafts, 0..k.
    tokens: [B, k+1] int32 emitted tokens: the accepted drafts, then the correction (if a draft was
        rejected) or the bonus (if all k were accepted) at index `num_accepted`, then -1.
    bonus: [B] int32, the token at index `num_accepted` (correction or bonus).
    """

    num_accepted: jax.Array
    tokens: jax.Array
    bonus: jax.Array


def _check_tree(tokens_bn: jax.Array, parents_bn: jax.Array, max_depth: int) -> None:
    """Boundary checks shared by the tree rules (shapes, dtypes, static depth)."""
    chex.assert_rank([tokens_bn, parents_bn], 2)
    chex.assert_equal_shape([tokens_bn, parents_bn])
    chex.assert_type([tokens_bn, parents_bn], jnp.int32)
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be a static int >= 0, got {max_depth!r}")
    if tokens_bn.shape[1] < 1:
        raise ValueError("a tree needs at least the root node")


def _sample_or_fallback(key: jax.Array, dist_bv: jax.Array, fallback_bv: jax.Array) -> jax.Array:
    """Sample one token per row from `dist` (unnormalised, >= 0); rows where it has no mass use `fallback`.

    The fallback only triggers when floating-point rounding leaves no residual mass (in exact arithmetic the
    callers reach it with probability 0); it keeps the output a valid token instead of an arbitrary index.
    """
    has_mass = jnp.sum(dist_bv, axis=-1, keepdims=True) > 0.0
    dist = jnp.where(has_mass, dist_bv, fallback_bv)
    return categorical(key, dist)  # normalises internally; zero-weight tokens are never drawn


def _emitted_tokens(
    accepted_tokens_bd: jax.Array, num_accepted_b: jax.Array, bonus_b: jax.Array
) -> jax.Array:
    """[B, D] accepted tokens (PAD past num_accepted) + bonus -> [B, D+1] with the bonus at num_accepted."""
    b, d = accepted_tokens_bd.shape
    out = jnp.concatenate([accepted_tokens_bd, jnp.full((b, 1), PAD, jnp.int32)], axis=1)
    pos = jnp.arange(d + 1, dtype=jnp.int32)[None, :]
    return jnp.where(pos == num_accepted_b[:, None], bonus_b[:, None], out)


def tree_accept(
    key: jax.Array,
    tokens_bn: jax.Array,
    parents_bn: jax.Array,
    target_probs_bnv: jax.Array,
    max_depth: int,
) -> TreeAcceptance:
    """Target-only tree sampling: walk the draft tree from the root, keeping drafts as the target would.

    At the current node c with target distribution p = p_c, draw one u ~ U[0, 1) and walk c's children in
    index order, accumulating the *working* mass of each child's token (p of the token, or 0 if an earlier
    sibling already carried the same token: that mass was already removed). The first child j with
    u * sum(p) < cum_j is accepted and the walk moves to it with a fresh uniform. If none is accepted the walk
    stops, and the bonus is sampled from p with all of c's children's tokens removed, renormalised (plain p if
    c has no children).

    Why it is exact: write S for the total mass of the distinct child tokens. Child token t is accepted with
    probability p(t) (the u-interval of length p(t) it owns); no child is accepted with probability 1 - S,
    and then the bonus gives token x (not a child token) probability p(x) / (1 - S). So the token emitted
    after c is x with probability p(x) for every x, whatever the drafter proposed; by induction along the walk
    (each step uses a fresh uniform and the distribution of the node reached, i.e. of the prefix emitted so
    far), every emitted token is distributed exactly as the target samples it. The comparison is strict
    (u * sum(p) < cum), so a token with p = 0 is never accepted even when u = 0, and scaling u by sum(p)
    makes the intervals tile the float32 vector's actual total mass. The only approximation left is the
    uniform's float32 resolution (2^-23).

    Args:
      key: PRNG key; each row uses independent randomness.
      tokens_bn: [B, N] int32 node tokens (the root's is ignored; padding tokens may be anything).
      parents_bn: [B, N] int32 parent index: -1 for the root, < i for drafted node i, -2 for padding.
      target_probs_bnv: [B, N, V] float32, `sampling.target_probs` of the target logits at each node.
      max_depth: static int, the deepest draft depth (root = depth 0). A smaller value truncates the walk
        there (still exact: the last node's untested children are not removed from its bonus distribution).

    Returns:
      TreeAcceptance (see its docstring); tokens/path padded with -1.
    """
    _check_tree(tokens_bn, parents_bn, max_depth)
    chex.assert_rank(target_probs_bnv, 3)
    chex.assert_equal_shape_prefix([tokens_bn, target_probs_bnv], 2)
    chex.assert_type(target_probs_bnv, jnp.float32)
    rows = jnp.arange(tokens_bn.shape[0])
    key_u, key_bonus = jax.random.split(key)
    tok, walked = _tree_walk(key_u, rows, tokens_bn, parents_bn, target_probs_bnv, max_depth)
    cur, live, n_acc, path, acc_tok = walked
    bonus = _tree_bonus(key_bonus, rows, parents_bn, tok, target_probs_bnv, cur, live)
    return TreeAcceptance(
        num_accepted=n_acc,
        path=path,
        tokens=_emitted_tokens(acc_tok, n_acc, bonus),
        bonus=bonus,
        last_node=cur,
    )


def _children_of(parents_bn: jax.Array, cur_b: jax.Array, live_b: jax.Array) -> jax.Array:
    """[B, N]: the nodes whose parent is the row's current node, in the rows still `live`."""
    return (parents_bn == cur_b[:, None]) & live_b[:, None]


def _tree_walk(
    key_u: jax.Array,
    rows: jax.Array,
    tokens_bn: jax.Array,
    parents_bn: jax.Array,
    target_probs_bnv: jax.Array,
    max_depth: int,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """`tree_accept`'s walk from the root: one loop trip per depth, with a fresh uniform per depth and row.

    Returns the node tokens clipped into the vocabulary [B, N] and the loop's final state: the current node
    [B], whether the row still walks [B] (False: it rejected every child of its current node), the accepted
    count [B], the path [B, max_depth + 1] and the accepted tokens [B, max_depth] (PAD past the count).
    """
    b, n = tokens_bn.shape
    v = target_probs_bnv.shape[-1]
    uniforms_bd = jax.random.uniform(key_u, (b, max(max_depth, 1)), jnp.float32)
    tok = jnp.clip(tokens_bn, 0, v - 1)  # padding tokens may be out of range; they are masked below
    total_bn = jnp.sum(target_probs_bnv, axis=-1)  # actual float32 mass of each node's distribution
    same_tok_nn = tok[:, :, None] == tok[:, None, :]  # [B, N, N]
    earlier_nn = jnp.tril(jnp.ones((n, n), bool), k=-1)  # [j, i]: i < j

    def step(d: int, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        cur, live, n_acc, path, acc_tok = state
        child = _children_of(parents_bn, cur, live)  # [B, N]
        # A child whose token an earlier sibling already carried has working mass 0 (zeroed on rejection).
        dup = jnp.any(child[:, None, :] & same_tok_nn & earlier_nn[None], axis=-1)
        mass = jnp.where(child & ~dup, target_probs_bnv[rows[:, None], cur[:, None], tok], 0.0)
        cum = jnp.cumsum(mass, axis=-1)
        thr = uniforms_bd[:, d] * total_bn[rows, cur]
        hit = child & (thr[:, None] < cum)
        accepted = jnp.any(hit, axis=-1)
        nxt = jnp.argmax(hit, axis=-1).astype(jnp.int32)  # first True
        path = path.at[:, d + 1].set(jnp.where(accepted, nxt, PAD))
        acc_tok = acc_tok.at[:, d].set(jnp.where(accepted, tokens_bn[rows, nxt], PAD))
        n_acc = n_acc + accepted.astype(jnp.int32)
        return jnp.where(accepted, nxt, cur), live & accepted, n_acc, path, acc_tok

    init = (
        jnp.zeros((b,), jnp.int32),
        jnp.ones((b,), bool),
        jnp.zeros((b,), jnp.int32),
        jnp.full((b, max_depth + 1), PAD, jnp.int32).at[:, 0].set(0),
        jnp.full((b, max_depth), PAD, jnp.int32),
    )
    return tok, jax.lax.fori_loop(0, max_depth, step, init)


def _tree_bonus(
    key_bonus: jax.Array,
    rows: jax.Array,
    parents_bn: jax.Array,
    tok: jax.Array,
    target_probs_bnv: jax.Array,
    cur: jax.Array,
    live: jax.Array,
) -> jax.Array:
    """[B] the bonus token after the walk: sampled from the last node's p minus its rejected children.

    A row that stopped (live=False) rejected every child of `cur`: remove their tokens. A row still live ran
    out of depth: its children (if any) were never tested, so nothing is removed.
    """
    b, v = tok.shape[0], target_probs_bnv.shape[-1]
    stopped_child = _children_of(parents_bn, cur, ~live)  # [B, N]
    removed_bv = jnp.zeros((b, v), bool).at[rows[:, None], tok].max(stopped_child)
    p_last = target_probs_bnv[rows, cur]  # [B, V]
    return _sample_or_fallback(key_bonus, jnp.where(removed_bv, 0.0, p_last), p_last)


def tree_accept_greedy(
    tokens_bn: jax.Array,
    parents_bn: jax.Array,
    target_argmax_bn: jax.Array,
    max_depth: int,
) -> TreeAcceptance:
    """Temperature-0 tree verification: accept the first child whose token is the target's argmax there.

    Exact because greedy decoding is deterministic: the emitted tokens are the accepted drafts (each equal to
    the argmax the target would have produced) followed by the argmax at the last accepted node, i.e.
    identical to plain greedy decoding. `tree_accept` on one-hot target probabilities returns the same result.

    No sequential walk: node i is on the accepted path iff it and each of its ancestors is the lowest-index
    child of its parent carrying the parent's argmax (what a walk from the root would pick), and whether all
    ancestors are is found by pointer doubling (log2 N rounds over [B, N], not max_depth dependent steps):
    on a GPU a walk of max_depth loop trips costs a round trip per trip.

    Args:
      tokens_bn, parents_bn, max_depth: the tree, as in `tree_accept`.
      target_argmax_bn: [B, N] int32, the target's argmax token following each node (a value no token
        takes, e.g. -1, where it is unknown: such a node's children are never accepted).
    """
    _check_tree(tokens_bn, parents_bn, max_depth)
    chex.assert_equal_shape([tokens_bn, target_argmax_bn])
    chex.assert_type(target_argmax_bn, jnp.int32)
    b, n = tokens_bn.shape
    rows = jnp.arange(b)
    node = jnp.arange(n, dtype=jnp.int32)
    par = jnp.where(parents_bn >= 0, parents_bn, node[None, :])  # root and padding point at themselves
    want = jnp.take_along_axis(target_argmax_bn, par, axis=1)
    hit = (parents_bn >= 0) & (tokens_bn == want)  # [B, N]: i carries its parent's argmax
    earlier_hit = (parents_bn[:, None, :] == parents_bn[:, :, None]) & hit[
        :, None, :
    ]  # [B, i, j]: sibling j hit
    first = hit & ~jnp.any(earlier_hit & (node[None, :] < node[:, None])[None], axis=-1)
    ok, depth, ptr = first | (node == 0)[None, :], (parents_bn >= 0).astype(jnp.int32), par
    for _ in range(max(1, (n - 1).bit_length())):  # after r rounds: the 2^r nearest ancestors folded in
        ok = ok & jnp.take_along_axis(ok, ptr, axis=1)
        depth = depth + jnp.take_along_axis(depth, ptr, axis=1)
        ptr = jnp.take_along_axis(ptr, ptr, axis=1)
    on = ok & (parents_bn != -2) & (depth <= max_depth)  # [B, N]: on the accepted path (the root included)
    at_depth = on[:, None, :] & (depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])  # [B, D+1, N]
    found = jnp.any(at_depth, axis=-1)
    path = jnp.where(found, jnp.argmax(at_depth, axis=-1), PAD).astype(jnp.int32)
    n_acc = jnp.sum(found[:, 1:], axis=-1).astype(jnp.int32)
    cur = path[rows, n_acc]
    acc_tok = jnp.where(found[:, 1:], jnp.take_along_axis(tokens_bn, jnp.clip(path[:, 1:], 0), axis=1), PAD)
    bonus = target_argmax_bn[rows, cur]
    return TreeAcceptance(
        num_accepted=n_acc,
        path=path,
        tokens=_emitted_tokens(acc_tok, n_acc, bonus),
        bonus=bonus,
        last_node=cur,
    )


def chain_accept_rejection(
    key: jax.Array,
    draft_tokens_bk: jax.Array,
    draft_probs_bkv: jax.Array,
    target_probs_bkv1: jax.Array,
) -> ChainAcceptance:
    """Speculative (rejection) sampling for a chain of k drafts with known draft distributions.

    Draft i (d_i ~ q_i) is accepted if u_i * q_i(d_i) < p_i(d_i) (i.e. u_i < p_i/q_i, probability
    min(1, p_i(d_i)/q_i(d_i))); at the first rejection the correction is sampled from norm(max(p_i - q_i, 0))
    and the chain stops; if all k are accepted the bonus is sampled from p_{k+1}.

    Why it is exact (Leviathan et al. 2023, Chen et al. 2023): the emitted token at step i has probability
    q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(p(x) - q(x), 0) / sum_y max(p(y) - q(y), 0)
    = min(p(x), q(x)) + max(p(x) - q(x), 0) = p(x). This requires that d_i was really drawn from q_i (pass the
    drafter's sampling distribution, after its own temperature/top-k); with q_i(d_i) = 0 the draft is accepted
    iff p_i(d_i) > 0, which is only exact if d_i was drawn from q_i.

    Args:
      key: PRNG key.
      draft_tokens_bk: [B, k] int32 drafted tokens.
      draft_probs_bkv: [B, k, V] float32 draft distributions q_i the drafts were sampled from.
      target_probs_bkv1: [B, k+1, V] float32 target distributions p_i (`sampling.target_probs`), the last one
        following the final draft.

    Returns:
      ChainAcceptance with tokens padded with -1.
    """
    chex.assert_rank([draft_tokens_bk, draft_probs_bkv, target_probs_bkv1], [2, 3, 3])
    chex.assert_type(
        [draft_tokens_bk, draft_probs_bkv, target_probs_bkv1], [jnp.int32, jnp.float32, jnp.float32]
    )
    chex.assert_equal_shape_prefix([draft_tokens_bk, draft_probs_bkv], 2)
    b, k = draft_tokens_bk.shape
    v = draft_probs_bkv.shape[-1]
    chex.assert_shape(target_probs_bkv1, (b, k + 1, v))
    rows = jnp.arange(b)

    key_u, key_bonus = jax.random.split(key)
    u_bk = jax.random.uniform(key_u, (b, k), jnp.float32)
    tok = jnp.clip(draft_tokens_bk, 0, v - 1)
    q_d = jnp.take_along_axis(draft_probs_bkv, tok[..., None], axis=-1)[..., 0]
    p_d = jnp.take_along_axis(target_probs_bkv1[:, :k], tok[..., None], axis=-1)[..., 0]
    ok = u_bk * q_d < p_d  # [B, k]
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)

    p_n = target_probs_bkv1[rows, n_acc]  # [B, V]
    q_n = draft_probs_bkv[rows, jnp.minimum(n_acc, k - 1)] if k > 0 else jnp.zeros_like(p_n)
    rejected = (n_acc < k)[:, None]
    residual = jnp.where(rejected, jnp.maximum(p_n - q_n, 0.0), p_n)
    bonus = _sample_or_fallback(key_bonus, residual, p_n)

    pos = jnp.arange(k, dtype=jnp.int32)[None, :]
    accepted_tokens = jnp.where(pos < n_acc[:, None], draft_tokens_bk, PAD)
    tokens = _emitted_tokens(accepted_tokens, n_acc, bonus)
    return ChainAcceptance(num_accepted=n_acc, tokens=tokens, bonus=bonus)


def plain_draws(keys_bn: jax.Array, target_probs_bnv: jax.Array) -> jax.Array:
    """[B, N] the token plain decoding draws at each node: `categorical(key, p[None])` with the node's own
    key, i.e. exactly `sampling.sample` (one uniform, inverse CDF) as a 1-token decode step calls it."""
    chex.assert_rank(target_probs_bnv, 3)
    b, n, v = target_probs_bnv.shape
    flat_k = keys_bn.reshape((b * n,) + keys_bn.shape[2:])
    draws = jax.vmap(lambda k, p: categorical(k, p[None])[0])(flat_k, target_probs_bnv.reshape(b * n, v))
    return draws.reshape(b, n).astype(jnp.int32)


def tree_accept_coupled(
    keys_bn: jax.Array,
    tokens_bn: jax.Array,
    parents_bn: jax.Array,
    target_probs_bnv: jax.Array,
    max_depth: int,
) -> TreeAcceptance:
    """Verification coupled to plain sampling: every emitted token IS the token plain decoding would draw.

    `keys_bn[b, i]` is the PRNG key plain decoding uses for the token after node i (the sequence's key folded
    with that token's index, `num_generated + depth[i]`). At each node the walk computes plain decoding's draw
    with that key (`plain_draws`) and accepts the drafted child carrying the same token; if no child does, the
    draw itself is the bonus token. So a speculative round emits the tokens a run of 1-token steps would emit
    wherever the T-token verify pass and the 1-token step compute the same probabilities: in float32 up to
    rare rounding flips of a draw whose uniform lands on a CDF boundary; in bfloat16 the two round apart and
    most sequences flip somewhere (docs/benchmarks.md), while each token stays distributed as p.

    Acceptance probability: the drafted child token t is accepted with probability p(t), the same as the
    target-only walk (`tree_accept`), i.e. the drafted children's distinct mass; and the output distribution
    is p because it is plain sampling's. It needs no draft probabilities, so any drafter and tree shape work.
    """
    _check_tree(tokens_bn, parents_bn, max_depth)
    chex.assert_equal_shape_prefix([tokens_bn, target_probs_bnv], 2)
    chex.assert_equal_shape_prefix([tokens_bn, keys_bn], 2)
    return tree_accept_greedy(tokens_bn, parents_bn, plain_draws(keys_bn, target_probs_bnv), max_depth)
