"""Dynamic k (docs/speculation.md#dynamic-k): the loop picks each dispatch's k among the k buckets
from the acceptance it has already read back.

The estimate is a per-position conditional acceptance a_i = P(draft i accepted | the drafts before
it accepted), from counts that decay by DECAY per round (a memory of ~10 rounds):

    a_i = (accepted_i + a_{i-1}) / (reached_i + 1),     a_{-1} = 1,

one pseudo-observation of the position before it, so a position with no recent evidence (a k that
fell never drafts it) follows the one before it, and a k that fell rises again once the drafts it
still verifies are accepted. A round at k emits on average

    E(k) = 1 + sum_{i < k} prod_{j <= i} a_j     tokens per row,

and costs cost(k) (the dispatch's time: drafting plus the verify of 1 + k tokens per row), so the
loop runs the bucket with the largest E(k) / cost(k); a larger k must beat a smaller one by more
than MARGIN (timing noise). The choice reads only earlier rounds, never the drafts it is about to
verify: the acceptance rule is unchanged, so greedy output stays plain greedy and sampled output
keeps the target's distribution.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.9  # per round: evidence older than ~1 / (1 - DECAY) = 10 rounds fades
MARGIN = 0.02  # a larger k must give this much more tokens per unit of cost than a smaller one


def k_buckets(k: int) -> tuple[int, ...]:
    """The ks dynamic k chooses among for a maximum k: the powers of two below k, and k itself
    (k = 8: 1, 2, 4, 8; k = 7: 1, 2, 4, 7)."""
    return tuple(sorted({1 << i for i in range(k.bit_length()) if 1 << i < k} | {k}))


def linear_costs(ks, c: float) -> np.ndarray:
    """The cost model cost(k) = 1 + c * k (in units of a round without drafts)."""
    return 1.0 + c * np.asarray(ks, np.float64)


def fitted_costs(ks, seconds) -> np.ndarray:
    """Measured dispatch times [len(ks)] smoothed by a least-squares line in k with a slope >= 0, so
    that timing noise never makes a larger k look cheaper than a smaller one."""
    ks, seconds = np.asarray(ks, np.float64), np.asarray(seconds, np.float64)
    slope = max(np.polyfit(ks, seconds, 1)[0], 0.0) if len(ks) > 1 else 0.0
    return np.mean(seconds) + slope * (ks - np.mean(ks))


class KChooser:
    """The acceptance estimate of one generate call and the choice of k it implies."""

    def __init__(self, ks: tuple[int, ...]):
        self.ks = tuple(ks)
        self.reached = np.zeros(self.ks[-1])  # [k_max] decayed count of rows that reached draft i
        self.accepted = np.zeros(self.ks[-1])  # [k_max] decayed count of rows that accepted draft i

    @property
    def accept(self) -> np.ndarray:
        """a_i for i = 0 .. k_max - 1 (no evidence at all: 1, so the first dispatch runs the largest k)."""
        a, prev = np.empty(self.ks[-1]), 1.0
        for i in range(len(a)):
            a[i] = prev = (self.accepted[i] + prev) / (self.reached[i] + 1)
        return a

    def expected_tokens(self) -> np.ndarray:
        """E(k) for k = 0 .. k_max [k_max + 1]."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.accept))])

    def choose(self, costs) -> int:
        """The k of self.ks with the most expected tokens per unit of cost (costs [len(ks)])."""
        rate = self.expected_tokens()[list(self.ks)] / np.asarray(costs, np.float64)
        best = 0
        for j in range(1, len(self.ks)):
            if rate[j] > (1 + MARGIN) * rate[best]:
                best = j
        return self.ks[best]

    def observe(self, k: int, num_emitted) -> None:
        """One round at k of the live rows (num_emitted [n] in 1 .. 1 + k): draft i was reached by
        the rows that accepted >= i drafts and accepted by those that accepted > i."""
        accepted = np.asarray(num_emitted)[:, None] - 1  # [n, 1]
        i = np.arange(self.ks[-1])[None, :]
        drafted = i < k
        self.reached = DECAY * self.reached + np.sum((accepted >= i) & drafted, axis=0)
        self.accepted = DECAY * self.accepted + np.sum((accepted > i) & drafted, axis=0)
