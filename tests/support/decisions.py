"""What the guard was asked, for the tests of where a loop or a framework decides: every `GuardedLoop.decide` call
and the plan it left, and a dataset of items whose length is a function of their index."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class Decided(NamedTuple):
    batch: int  # what decide() was given: the effective batch ...
    seq_len: int  # ... and the sequence length
    in_hand: bool
    steps: int  # the loop's steps when it was asked
    plan: object  # the loop's next_plan() right after (None after a stop)


def spy_decisions(monkeypatch) -> list[Decided]:
    """Every `GuardedLoop.decide` from now on (any loop), in order."""
    from gpuwatch.integrations.loop import GuardedLoop

    calls: list[Decided] = []
    real = GuardedLoop.decide

    def spy(self, n, s, in_hand=False):
        steps = self.steps
        out = real(self, n, s, in_hand=in_hand)
        calls.append(Decided(n, s, in_hand, steps, self.next_plan()))
        return out

    monkeypatch.setattr(GuardedLoop, "decide", spy)
    return calls


class LengthData(torch.utils.data.Dataset):
    """`n` items of random token ids, item i `length_of(i)` long (its own seed: the same data every run)."""

    def __init__(self, n: int, length_of: Callable[[int], int], vocab: int = 64) -> None:
        self.n, self.length_of, self.vocab = n, length_of, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return (torch.randint(0, self.vocab, (self.length_of(i),), generator=torch.Generator().manual_seed(i)),)
