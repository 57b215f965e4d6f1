"""Automatic prefix caching: the keys and values of a prompt computed once, reused by the requests that start alike.

Each slot of the engine's cache keeps the keys and values of the prompt its request prefilled
(positions 0, 1, ... of its row) after the request leaves, until a new request's prefill writes over
them. A new request whose prompt starts with tokens a slot holds (whole blocks of `BLOCK` tokens,
leaving at least one token to prefill, whose logits give the first new one) starts from there: it
takes that slot if it is free (nothing to copy), else the free slot used least recently, into which
the engine copies the matched positions from the slot holding them (running or not); its prefill
runs from the first position not matched (see `buckets.next_piece`). Free slots are
taken least recently used first: that is the eviction, under the only memory pressure a cache of
fixed slots has (more prompts than slots). Answers' positions are not reused: a chat's next turn
reuses its prompt's, which hold the earlier turns.

The slots hold few prompts (one each), so a prompt is compared with each slot's tokens directly
rather than through hashes of blocks, as a paged cache of many blocks needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK = 16  # a prefix is reused in whole blocks of this many tokens


@dataclass
class PrefixCache:
    """What each slot of the engine's cache holds: the tokens whose keys and values its first
    positions hold (`held`), and when it was last given a request (`used`).

    Args:
        slots (`int`): the engine's slots.
    """

    slots: int
    held: list[list[int]] = field(init=False)
    used: list[int] = field(init=False)
    queried: int = 0  # prompt tokens of the requests placed
    hits: int = 0  # of those, the tokens whose keys and values were reused
    _clock: int = 0

    def __post_init__(self) -> None:
        self.held = [[] for _ in range(self.slots)]
        self.used = [0] * self.slots

    def matched(self, slot: int, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens `slot` holds, in whole blocks, leaving one to prefill."""
        held, limit, count = self.held[slot], min(len(self.held[slot]), len(prompt) - 1), 0
        while count < limit and held[count] == prompt[count]:
            count += 1
        return count // BLOCK * BLOCK

    def place(self, prompt: list[int], free: list[int], reuse: bool = True) -> tuple[int, int | None, int]:
        """Where a request with `prompt` goes among the `free` slots: (slot, donor, matched), the
        slot to copy its `matched` first positions from (None: nothing to copy). Without `reuse`
        (a request that scores its whole prompt), nothing is matched."""
        matches = [self.matched(slot, prompt) if reuse else 0 for slot in range(self.slots)]
        best = max(range(self.slots), key=lambda slot: (matches[slot], slot in free))
        matched = matches[best]
        if matched and best in free:
            slot, donor = best, None
        else:
            slot, donor = min(free, key=lambda slot: self.used[slot]), best if matched else None
        self._clock += 1
        self.used[slot], self.held[slot] = self._clock, prompt[:matched]
        self.queried, self.hits = self.queried + len(prompt), self.hits + matched
        return slot, donor, matched

    def written(self, slot: int, tokens: list[int]) -> None:
        """`slot`'s first positions now hold `tokens` (a prefill piece ended)."""
        self.held[slot] = tokens

    def overwritten(self, slots: list[int] | range, position: int) -> None:
        """`slots` hold nothing reusable from `position` on (a step wrote pad tokens there)."""
        for slot in slots:
            self.held[slot] = self.held[slot][:position]
