"""The simulated engine's slot allocator: LIFO reuse, double frees counted, and the fault hook
`force_free` (a slot put back on top of the free list while still referenced; mutation audit)."""
from kvcanary.engines.sim.pool import PADDING_SLOT, SlotAllocator


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
