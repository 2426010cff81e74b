"""History drafter: model-free drafts from what the policy wrote for the same prompt before (SuffixDecoding).

RL revisits every prompt once per epoch and the policy's responses to a prompt move slowly between steps, so
its earlier responses, the current group's finished siblings and the prompt itself predict a row's next
tokens. Per prompt, a suffix automaton over those strings (each response prefixed with the prompt's last
`max_match` tokens, so a match can straddle the prompt/response boundary) finds the longest suffix of a row's
context (at most `max_match` tokens) that occurred before, and drafts a tree of its most frequent
continuations, best first by the empirical path probability (occurrence counts; candidates below `min_prob`
dropped), at most `spec_factor * match length` nodes (SuffixDecoding's rule: a long match earns a big tree, a
short one a small one), within the strategy's depth, top-k and tokens_to_verify. The work is host-side; the
drafts go to the device as a `DraftTree` and pass the same coupled verification as every draft, so SD stays
exact whatever the history holds (`history_rounds.py` runs the rounds).

Memory is bounded: at most `max_prompt_tokens` response tokens per prompt and `max_tokens` in total, the
oldest responses evicted first (the prompt's automaton is then rebuilt from what remains). The stored strings
(`state_arrays`) go into the run's checkpoint. Drafts depend only on the multiset of a prompt's strings (the
automaton and its counts do not depend on insertion order; ties break by token id), so a resumed run drafts
as the uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import sys
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class HistoryParams:
    """The history drafter's settings (`SpecConfig.history_*`)."""

    max_match: int = 32  # longest context suffix matched (and the prompt tail prefixed to each response)
    # draft at most spec_factor * match length nodes (SuffixDecoding's rule; its serving default is 1.0 with
    # min_prob 0.1, where every drafted token costs verify work). A round here verifies a static
    # tokens_to_verify whatever is drafted, so unused nodes buy nothing: replaying SmolLM2's chain_sum
    # responses (3 epochs x 8, chains of 3) accepted 1.35 with (1.0, 0.1) and 1.43 with (4.0, 0.0)
    spec_factor: float = 4.0
    min_prob: float = 0.0  # drop continuations whose empirical path probability is below this
    max_prompt_tokens: int = 65_536  # response tokens kept per prompt (oldest evicted first)
    max_tokens: int = 4_194_304  # response tokens kept in total (16 MiB of int32)

    def __post_init__(self) -> None:
        if self.max_match < 1 or self.spec_factor <= 0 or not 0 <= self.min_prob <= 1:
            raise ValueError(
                "history drafter: need history_max_match >= 1, history_spec_factor > 0 and 0 <= "
                f"history_min_prob <= 1, got {self.max_match}, {self.spec_factor}, {self.min_prob}"
            )
        if self.max_prompt_tokens < 1 or self.max_tokens < self.max_prompt_tokens:
            raise ValueError(
                "history drafter: need 1 <= history_max_prompt_tokens <= history_max_tokens, got "
                f"{self.max_prompt_tokens} and {self.max_tokens}"
            )


class SuffixAutomaton:
    """A generalized suffix automaton over int sequences: every substring of the added strings is a path from
    state 0; `counts()[s]` is how often the strings of state s occur (end positions over all strings)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.base: list[int] = [0]
        self._counts: list[int] | None = None

    def __len__(self) -> int:
        return len(self.length)

    def _new(self, length: int, nxt: dict[int, int], link: int) -> int:
        self.next.append(nxt)
        self.length.append(length)
        self.link.append(link)
        self.base.append(0)
        return len(self.length) - 1

    def _clone(self, p: int, q: int, c: int) -> int:
        """Split state q (reached from p by c) so that length[p] + 1 is a state's longest string."""
        nxt, link = self.next, self.link
        clone = self._new(self.length[p] + 1, dict(nxt[q]), link[q])
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        link[q] = clone
        return clone

    def _extend(self, last: int, c: int) -> int:
        nxt, link, length = self.next, self.link, self.length
        q = nxt[last].get(c)
        if q is not None:  # the prefix already occurred (generalized automaton: another string)
            return q if length[last] + 1 == length[q] else self._clone(last, q, c)
        cur = self._new(length[last] + 1, {}, 0)
        p = last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            link[cur] = q if length[p] + 1 == length[q] else self._clone(p, q, c)
        return cur

    def add(self, tokens: Sequence[int]) -> None:
        """Add one string (its prefixes' end positions count once each)."""
        last = 0
        for c in tokens:
            last = self._extend(last, int(c))
            self.base[last] += 1
        self._counts = None

    def counts(self) -> list[int]:
        """Occurrences of each state's strings (computed once per change: a pass over the suffix links)."""
        if self._counts is None:
            cnt = list(self.base)
            for v in sorted(range(1, len(cnt)), key=self.length.__getitem__, reverse=True):
                cnt[self.link[v]] += cnt[v]
            self._counts = cnt
        return self._counts

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of `context` that occurs in the added strings."""
        nxt, link, length = self.next, self.link, self.length
        s, n = 0, 0
        for c in context:
            c = int(c)
            while s and c not in nxt[s]:
                s = link[s]
                n = length[s]
            if c in nxt[s]:
                s, n = nxt[s][c], n + 1
        return s, n

    def host_bytes(self) -> int:
        """Bytes the automaton holds (its lists and transition dicts)."""
        lists = sum(sys.getsizeof(x) for x in (self.next, self.link, self.length, self.base))
        return lists + sum(sys.getsizeof(d) for d in self.next) + 28 * 3 * len(self.length)


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """What a draft tree may use: its depth, branches per node, drafted nodes (tokens_to_verify - 1) and
    nodes with children (the strategy's `draft_slots`: the nodes a round computes logits at)."""

    depth: int
    topk: int
    nodes: int
    internal: int


def draft_tree(
    sam: SuffixAutomaton, state: int, match_len: int, shape: TreeShape, params: HistoryParams
) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, depths) of the drafted nodes (the root excluded; parents index the full tree, 0 =
    the root): best first by path probability cnt(child) / cnt(state) products, at most
    min(shape.nodes, spec_factor * match_len) nodes, each node's children in order of preference."""
    budget = min(shape.nodes, int(params.spec_factor * match_len))
    if match_len == 0 or budget <= 0:
        return [], [], []
    cnt = sam.counts()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    internal: set[int] = set()
    heap: list[tuple[float, int, int, int, int, int]] = []  # (-prob, order, parent, token, state, depth)
    order = 0

    def push(node: int, s: int, prob: float, depth: int) -> None:
        nonlocal order
        if depth >= shape.depth or cnt[s] <= 0:
            return
        kids = heapq.nsmallest(shape.topk, sam.next[s].items(), key=lambda kv: (-cnt[kv[1]], kv[0]))
        for tok, child in kids:
            p = prob * cnt[child] / cnt[s]
            if p >= params.min_prob:
                heapq.heappush(heap, (-p, order, node, tok, child, depth + 1))
                order += 1

    push(0, state, 1.0, 0)
    while heap and len(tokens) < budget:
        neg_p, _, parent, tok, child, depth = heapq.heappop(heap)
        if parent not in internal and len(internal) >= shape.internal:
            continue
        internal.add(parent)
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        push(len(tokens), child, -neg_p, depth)
    return tokens, parents, depths


class PromptHistory:
    """One prompt's strings: the prompt and its kept responses (oldest first), and their automaton."""

    def __init__(self, prompt: np.ndarray, max_match: int):
        self.prompt = np.asarray(prompt, np.int32)
        self.tail = self.prompt[-max_match:]
        self.responses: collections.deque[tuple[int, np.ndarray]] = collections.deque()  # (seq, tokens)
        self.tokens = 0
        self._sam: SuffixAutomaton | None = None

    def automaton(self) -> SuffixAutomaton:
        if self._sam is None:  # built anew after an eviction (or a restore): from the strings kept
            self._sam = SuffixAutomaton()
            self._sam.add(self.prompt)
            for _, r in self.responses:
                self._sam.add(np.concatenate([self.tail, r]))
        return self._sam

    def append(self, seq: int, response: np.ndarray) -> None:
        self.responses.append((seq, response))
        self.tokens += len(response)
        if self._sam is not None:
            self._sam.add(np.concatenate([self.tail, response]))

    def pop_oldest(self) -> int:
        _, r = self.responses.popleft()
        self.tokens -= len(r)
        self._sam = None
        return len(r)


def prompt_key(prompt: Sequence[int] | np.ndarray) -> bytes:
    """A prompt's identity in the store: a digest of its token ids."""
    return hashlib.blake2b(np.asarray(prompt, np.int32).tobytes(), digest_size=16).digest()


@dataclasses.dataclass
class HistoryStats:
    """Counters of the history drafter since they were last read (`HistoryStore.take_stats`)."""

    rounds: int = 0  # row-rounds drafted
    matched: int = 0  # row-rounds with a match (a draft of >= 1 node)
    match_tokens: int = 0  # summed match lengths
    nodes: int = 0  # drafted nodes
    draft_seconds: float = 0.0  # host time drafting
    added: int = 0  # responses added
    evicted: int = 0  # responses evicted


class HistoryStore:
    """Every prompt's history (see the module docstring): what the engine's rollouts wrote, kept across
    rollouts (the engine owns it; the learner checkpoints `state_arrays`)."""

    def __init__(self, params: HistoryParams):
        self.params = params
        self.prompts: dict[bytes, PromptHistory] = {}
        self.order: collections.deque[tuple[int, bytes]] = collections.deque()  # (seq, key), oldest first
        self.total = 0  # response tokens kept
        self.next_seq = 0
        self.evicted_total = 0  # responses evicted since the store was made (not checkpointed)
        self.stats = HistoryStats()

    def prompt(self, tokens: Sequence[int] | np.ndarray) -> PromptHistory:
        """The prompt's history (created empty on first sight: the prompt alone is a source)."""
        key = prompt_key(tokens)
        ph = self.prompts.get(key)
        if ph is None:
            ph = self.prompts[key] = PromptHistory(np.asarray(tokens, np.int32), self.params.max_match)
        return ph

    def add(self, prompt: Sequence[int] | np.ndarray, response: Sequence[int] | np.ndarray) -> None:
        """Keep a finished response of `prompt`, then evict the oldest responses past the caps."""
        resp = np.asarray(response, np.int32)
        if not len(resp):
            return
        ph = self.prompt(prompt)
        ph.append(self.next_seq, resp)
        self.order.append((self.next_seq, prompt_key(prompt)))
        self.next_seq += 1
        self.total += len(resp)
        self.stats.added += 1
        while ph.tokens > self.params.max_prompt_tokens:
            self._evicted(ph)
        while self.total > self.params.max_tokens:
            seq, key = self.order.popleft()
            old = self.prompts.get(key)
            if old is not None and old.responses and old.responses[0][0] == seq:
                self._evicted(old)

    def _evicted(self, ph: PromptHistory) -> None:
        self.total -= ph.pop_oldest()
        self.stats.evicted += 1
        self.evicted_total += 1

    def end_rollout(self) -> None:
        """Forget the prompts with no response kept, and the eviction queue's stale entries."""
        self.prompts = {k: p for k, p in self.prompts.items() if p.responses}
        kept = {s for p in self.prompts.values() for s, _ in p.responses}
        self.order = collections.deque(e for e in self.order if e[0] in kept)

    def draft(
        self, histories: Sequence[PromptHistory | None], contexts: Sequence[np.ndarray], shape: TreeShape
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Draft trees for B rows ([B, 1 + shape.nodes] tokens, parents, depths in `DraftTree`'s layout; the
        root's token is left 0 for the device to fill): row i drafts from histories[i] (None: a padding row)
        with context contexts[i] (its last tokens, prompt included)."""
        b, n = len(histories), 1 + shape.nodes
        tokens = np.zeros((b, n), np.int32)
        parents = np.full((b, n), -2, np.int32)
        parents[:, 0] = -1
        depths = np.zeros((b, n), np.int32)
        k = self.params.max_match
        for i, (ph, ctx) in enumerate(zip(histories, contexts, strict=True)):
            if ph is None:
                continue
            sam = ph.automaton()
            state, length = sam.match(ctx[-k:])
            tok, par, dep = draft_tree(sam, state, length, shape, self.params)
            m = len(tok)
            tokens[i, 1 : 1 + m], parents[i, 1 : 1 + m], depths[i, 1 : 1 + m] = tok, par, dep
            self.stats.rounds += 1
            self.stats.matched += int(m > 0)
            self.stats.match_tokens += length
            self.stats.nodes += m
        return tokens, parents, depths

    def take_stats(self) -> HistoryStats:
        """The counters since the last call (then reset)."""
        out, self.stats = self.stats, HistoryStats()
        return out

    def host_bytes(self) -> int:
        """Host memory the store holds: the kept strings and the built automata."""
        strings = sum(p.prompt.nbytes + sum(r.nbytes for _, r in p.responses) for p in self.prompts.values())
        autom = sum(p._sam.host_bytes() for p in self.prompts.values() if p._sam is not None)
        return strings + autom

    def metrics(self) -> dict[str, float]:
        """Its size (prompts, kept responses and tokens, host bytes) for the step's metrics."""
        return {
            "history/prompts": float(len(self.prompts)),
            "history/responses": float(sum(len(p.responses) for p in self.prompts.values())),
            "history/tokens": float(self.total),
            "history/host_mib": self.host_bytes() / 2**20,
        }

    # ---- checkpoint ----------------------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """The kept strings as arrays (the checkpoint's "history"): sizes [3] (prompts, responses, next seq),
        prompt_lens [P], responses [R, 3] (prompt slot, length, seq), tokens [T] (prompts, then responses
        oldest first). Every array has at least one element (padding)."""
        kept = [(s, r, slot) for slot, p in enumerate(self.prompts.values()) for s, r in p.responses]
        kept.sort(key=lambda e: e[0])
        prompts = list(self.prompts.values())
        meta = np.asarray([(slot, len(r), s) for s, r, slot in kept], np.int32).reshape(-1, 3)
        parts = [p.prompt for p in prompts] + [r for _, r, _ in kept]
        tokens = np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32)
        lens = np.asarray([len(p.prompt) for p in prompts], np.int32)
        pad = lambda a: a if len(a) else np.zeros((1, *a.shape[1:]), np.int32)  # noqa: E731
        return {
            "sizes": np.asarray([len(prompts), len(kept), self.next_seq], np.int32),
            "prompt_lens": pad(lens),
            "responses": pad(meta),
            "tokens": pad(tokens),
        }

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the store's content with a checkpoint's `state_arrays` (the automata rebuild lazily)."""
        a = {k: np.asarray(v) for k, v in arrays.items()}
        num_p, num_r, self.next_seq = (int(x) for x in a["sizes"])
        lens, tokens = a["prompt_lens"][:num_p], a["tokens"]
        starts = np.concatenate([[0], np.cumsum(lens)])
        prompts = [tokens[starts[i] : starts[i + 1]] for i in range(num_p)]
        self.prompts, self.order, self.total = {}, collections.deque(), 0
        histories = [self.prompt(p) for p in prompts]
        pos = int(starts[-1])
        for slot, length, seq in a["responses"][:num_r]:
            r = tokens[pos : pos + length].copy()
            pos += int(length)
            histories[int(slot)].append(int(seq), r)
            self.order.append((int(seq), prompt_key(prompts[int(slot)])))
            self.total += int(length)
        for ph in histories:
            ph._sam = None
