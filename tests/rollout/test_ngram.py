"""Unit tests of the model-free n-gram drafter (tlt_jax/rollout/ngram.py) on hand-made histories.

Each case spells out the expected draft, so a wrong match rule, source, ranking or tree layout fails.
All calls go through one jitted wrapper per static configuration (small shapes, compiled once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rollout import ngram

N_OUT = 12  # response buffer length
TP = 8  # prompt buffer length


@functools.partial(jax.jit, static_argnames=("group", "depth", "topk", "nodes", "max_ngram", "min_ngram"))
def _draft(
    prompt, plen, out, ngen, seq, bank, bank_len, root, *, group, depth, topk, nodes, max_ngram=4, min_ngram=1
):
    src, src_len, prio, q = ngram.build_sources(
        prompt, plen, out, ngen, seq, bank, bank_len, group, max_ngram, max_siblings=4
    )
    return ngram.propose(
        src, src_len, prio, q, root, depth=depth, topk=topk, num_nodes=nodes, min_ngram=min_ngram
    )


def _pad(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _case(prompts, responses, bank_rows=None, group=1, **kw):
    """Run the drafter for rows whose seq ids are 0..B-1; the bank holds `bank_rows` (default: responses)."""
    b = len(prompts)
    bank_rows = responses if bank_rows is None else bank_rows
    tree = _draft(
        jnp.asarray(_pad(prompts, TP)),
        jnp.asarray([len(p) for p in prompts], jnp.int32),
        jnp.asarray(_pad(responses, N_OUT)),
        jnp.asarray([len(r) for r in responses], jnp.int32),
        jnp.arange(b, dtype=jnp.int32),
        jnp.asarray(_pad(bank_rows, N_OUT)),
        jnp.asarray([len(r) for r in bank_rows], jnp.int32),
        jnp.asarray([r[-1] for r in responses], jnp.int32),
        group=group,
        **kw,
    )
    return jax.tree_util.tree_map(np.asarray, tree)


def _chain(tree, row: int) -> list[int]:
    """Tokens of the chain below the root (stops at the first padding node)."""
    toks = []
    for i in range(1, tree.tokens.shape[1]):
        if tree.parents[row, i] == -2:
            break
        assert tree.parents[row, i] == i - 1
        assert tree.depth[row, i] == i
        toks.append(int(tree.tokens[row, i]))
    return toks


def test_chain_from_own_response_repetition():
    # prompt 1 2 3, response 4 5 6 4 5: the last tokens "4 5" occurred before, followed by "6 4 5".
    tree = _case([[1, 2, 3]], [[4, 5, 6, 4, 5]], depth=3, topk=1, nodes=4)
    assert _chain(tree, 0) == [6, 4, 5]
    assert tree.tokens[0, 0] == 5 and tree.parents[0, 0] == -1


def test_match_straddles_prompt_and_response_then_padding():
    # prompt 1 2 3 9, response 7 3: "3" occurred in the prompt followed by 9, then the response's 7 3; the
    # text ends there, so a depth-4 chain has 3 drafts and one padding node.
    tree = _case([[1, 2, 3, 9]], [[7, 3]], depth=4, topk=1, nodes=5)
    assert _chain(tree, 0) == [9, 7, 3]
    assert list(tree.parents[0]) == [-1, 0, 1, 2, -2]


def test_sibling_response_and_longest_match_win():
    # row 0 has written "7 8"; its sibling (row 1, same prompt) wrote "7 8 9 10 11". Row 0's query
    # "8 5 7 8" matches the sibling across the prompt tail (length 4) and beats the 1-token matches of "8"
    # in the prompt (-> 5) and in its own text (-> 5 7 8).
    prompts = [[1, 2, 3, 8, 5], [1, 2, 3, 8, 5]]
    responses = [[7, 8], [7, 8, 9, 10, 11]]
    tree = _case(prompts, responses, group=2, depth=3, topk=1, nodes=4)
    assert _chain(tree, 0) == [9, 10, 11]
    # row 1 queries "... 9 10 11": nothing matches except via its own tokens -> no usable match
    assert list(tree.parents[1]) == [-1, -2, -2, -2]


def test_no_match_gives_only_padding():
    tree = _case([[1, 2]], [[3]], depth=2, topk=2, nodes=5)
    assert list(tree.parents[0]) == [-1, -2, -2, -2, -2]
    assert list(tree.depth[0]) == [0, 0, 0, 0, 0]


def test_topk_tree_distinct_first_tokens_breadth_first():
    # "5" is followed by 6 7 (earlier) and 8 9 (later) in the response: two branches with distinct first
    # tokens; the later (more recent) match ranks first. Layout: node 1 + t*topk + b.
    tree = _case([[1]], [[5, 6, 7, 5, 8, 9, 5]], depth=2, topk=2, nodes=5)
    assert list(tree.parents[0]) == [-1, 0, 0, 1, 2]
    assert list(tree.depth[0]) == [0, 1, 1, 2, 2]
    assert list(tree.tokens[0, 1:]) == [8, 6, 9, 7]
    # a smaller verify budget keeps the shallow nodes
    small = _case([[1]], [[5, 6, 7, 5, 8, 9, 5]], depth=2, topk=2, nodes=3)
    assert list(small.parents[0]) == [-1, 0, 0]
    assert list(small.tokens[0, 1:]) == [8, 6]


def test_longer_continuation_beats_recency_on_ties():
    # "5" follows "9" ... twice with equal 1-token matches: earlier it is followed by 6 7 8 (3 tokens), later
    # by 2 5 (2 tokens): the longer continuation wins over the more recent one.
    tree = _case([[9]], [[5, 6, 7, 8, 5, 2, 5]], depth=3, topk=1, nodes=4)
    assert _chain(tree, 0) == [6, 7, 8]


def test_min_ngram_rejects_short_matches():
    tree = _case([[1, 2]], [[5, 6, 7, 5]], depth=2, topk=1, nodes=3, min_ngram=2)
    assert list(tree.parents[0]) == [-1, -2, -2]
    tree = _case([[1, 2]], [[5, 6, 7, 5]], depth=2, topk=1, nodes=3, min_ngram=1)
    assert _chain(tree, 0) == [6, 7]


def test_update_bank_writes_by_sequence_id_and_drops_padding():
    bank = jnp.zeros((3, 4), jnp.int32)
    bank_len = jnp.zeros((3,), jnp.int32)
    out = jnp.asarray([[1, 2, 0, 0], [3, 4, 5, 0], [9, 9, 9, 9]], jnp.int32)
    num = jnp.asarray([2, 3, 4], jnp.int32)
    seq = jnp.asarray([2, 0, -1], jnp.int32)
    bank, bank_len = jax.jit(ngram.update_bank)(bank, bank_len, out, num, seq)
    np.testing.assert_array_equal(np.asarray(bank), [[3, 4, 5, 0], [0, 0, 0, 0], [1, 2, 0, 0]])
    np.testing.assert_array_equal(np.asarray(bank_len), [3, 0, 2])
