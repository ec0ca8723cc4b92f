"""The simulated engine's slot allocator: LIFO reuse, double frees counted, and the fault hook
`force_free` (a slot put back on top of the free list while still referenced; mutation audit)."""
import random

import torch

from kvcanary.engines.sim.pool import PADDING_SLOT, RequestTable, SlotAllocator


def test_force_free_puts_a_used_slot_on_top_and_marks_it_free():
    a = SlotAllocator(8)
    s1, s2, s3 = a.alloc(3)
    a.force_free(s2)
    assert not bool(a.in_use[s2]) and bool(a.in_use[s1]) and bool(a.in_use[s3])
    assert a.num_free == 8 - 1 - 2
    assert a.alloc(1) == [s2]  # reused first
    assert bool(a.in_use[s2])


def test_force_free_of_a_free_slot_moves_it_to_the_top_without_a_duplicate():
    a = SlotAllocator(8)
    (s1,) = a.alloc(1)
    free_before = a.num_free
    deep = 7  # still on the free list, at its bottom
    a.force_free(deep)
    assert a.num_free == free_before and a.alloc(1) == [deep]
    a.free([deep, deep, PADDING_SLOT])  # the second free of the same slot is counted, padding ignored
    assert a.double_frees == 1 and a.num_free == free_before
    assert sorted(a.alloc(a.num_free)) == sorted(set(range(1, 8)) - {s1})


def test_free_skips_padding_and_counts_every_double_free():
    a = SlotAllocator(8)
    s1, s2 = a.alloc(2)
    a.free([PADDING_SLOT, s1, s2])  # padding first: the slots after it are still freed
    assert not bool(a.in_use[s1]) and not bool(a.in_use[s2]) and a.num_free == 7
    a.free([s1])
    a.free([s2, s1])
    assert a.double_frees == 3 and a.num_free == 7
    assert a.alloc(2) == [s2, s1]  # LIFO: the last freed (s2) comes back first


def test_request_rows_run_out_without_an_error_and_padding_row_is_never_handed_out():
    t = RequestTable(max_requests=3, max_context=4)
    rows = [t.alloc_row(), t.alloc_row()]
    assert sorted(rows) == [1, 2] and t.alloc_row() is None and t.num_free == 0
    t.req_to_token[rows[0]] = 9
    t.free_row(rows[0])
    assert t.req_to_token[rows[0]].tolist() == [0, 0, 0, 0] and t.alloc_row() == rows[0]


def test_live_lists_the_slots_in_use_ascending_after_random_allocs_and_frees():
    rng = random.Random(4)
    alloc = SlotAllocator(300)
    held: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.4:
            k = rng.randint(1, len(held))
            rng.shuffle(held)
            alloc.free(held[:k])
            held = held[k:]
        else:
            held += alloc.alloc(rng.randint(0, 9)) or []
        live = alloc.live()
        assert live.dtype == torch.int64 and live.tolist() == sorted(held)
