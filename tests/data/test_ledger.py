"""The shard ledger against a simulated job: random world sizes, batch sizes, failures and
restores; the model must train every sample of every epoch exactly once."""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrover_hpc.data.ledger import Ledger, Spec, _merge


def _ranges(samples: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    return _merge((e, p, p + 1) for e, p in samples)


segment = st.tuples(
    st.integers(1, 5),  # world size
    st.integers(1, 4),  # batch size per rank
    st.integers(0, 12),  # batches drawn before the failure
    st.floats(0, 1),  # which earlier batch count the next round restores
)


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 120),
    shard=st.integers(1, 17),
    epochs=st.integers(1, 2),
    segments=st.lists(segment, min_size=1, max_size=6),
    last=st.tuples(st.integers(1, 5), st.integers(1, 4)),
)
def test_every_sample_reaches_the_model_exactly_once(
    size: int, shard: int, epochs: int, segments: list, last: tuple[int, int]
) -> None:
    ledger = Ledger(Spec(size=size, shard_size=shard, epochs=epochs))
    model: list[list[tuple[int, int]]] = []  # model[b]: the samples of batch b, all ranks
    restore = 0
    plan = [*segments, (*last, 10**6, 0.0)]  # the last round runs to the end of the data
    for round_no, (world, batch, draws, where) in enumerate(plan, 1):
        ledger.start_round(round_no, start=restore, batch_size=batch)
        del model[restore:]  # the restored model has not seen what came after
        assert ledger.trained() == _ranges([s for b in model for s in b])
        streams: dict[int, deque[tuple[int, int]]] = {r: deque() for r in range(world)}
        for _ in range(draws):
            samples: list[tuple[int, int]] = []
            for rank, stream in streams.items():
                while len(stream) < batch and (h := ledger.next(round_no, rank)) is not None:
                    stream.extend((h.epoch, p) for p in range(h.start, h.end))
                samples += [stream.popleft() for _ in range(min(batch, len(stream)))]
            if not samples:
                break
            model.append(samples)
        restore = int(where * len(model))  # an earlier checkpoint, or the newest
    seen = Counter(s for b in model for s in b)
    assert seen == Counter((e, p) for e in range(epochs) for p in range(size))
    # A round after the last one, resuming at its end, finds every sample trained.
    ledger.start_round(len(plan) + 1, start=len(model), batch_size=1)
    assert ledger.finished() and ledger.trained() == [(e, 0, size) for e in range(epochs)]


def test_records_round_trip_and_bad_input() -> None:
    ledger = Ledger(Spec(size=10, shard_size=4))
    ledger.start_round(1, start=0, batch_size=2)
    a, b = ledger.next(1, 0), ledger.next(1, 1)
    assert a is not None and b is not None and (a.start, a.end, b.start, b.end) == (0, 4, 4, 8)
    ledger.start_round(2, start=1, batch_size=2)  # each rank kept its first batch (2 samples)
    assert ledger.trained() == [(0, 0, 2), (0, 4, 6)]
    again = Ledger.from_records(ledger.to_records())
    assert again.trained() == ledger.trained() and again.todo() == [(0, 2, 4), (0, 6, 10)]
    with pytest.raises(ValueError, match="not the current round"):
        ledger.next(1, 0)
    with pytest.raises(ValueError, match="shard_size=0"):
        Spec(size=10, shard_size=0)
