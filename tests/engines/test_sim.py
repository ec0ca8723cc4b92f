"""The simulated engine: deterministic, padding named and never handed out, and its workload
really exercises sharing, eviction, sliding-window recycling, retraction and aborts."""
import torch

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload, SlotAllocator
from kvcanary.engines.sim.engine import kv_bytes


def _fingerprint(engine: SimEngine) -> tuple:
    kv = tuple(int(t.to(torch.int64).sum()) for pair in engine.kv.values() for t in pair)
    return kv, engine.finished, engine.aborted, engine.retracted, engine.evicted_blocks, engine.cache_hit_tokens


def test_same_seed_same_run_other_seed_other_run():
    runs = []
    for seed in (5, 5, 6):
        engine = SimEngine(SimConfig(seed=seed, sliding_window=16, num_slots=512, swa_num_slots=192))
        engine.run(150, SimWorkload(seed=seed))
        runs.append(_fingerprint(engine))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_padding_slot_and_row_are_never_handed_out():
    alloc = SlotAllocator(8)
    assert sorted(alloc.alloc(7)) == list(range(1, 8)) and alloc.alloc(1) is None
    alloc.free([3, 3])
    assert alloc.double_frees == 1 and alloc.alloc(1) == [3]
    engine = SimEngine(SimConfig(seed=1, num_slots=256))
    engine.run(100)
    assert not bool(engine.full_alloc.in_use[0])
    assert bool((engine.table.req_to_token[0] == 0).all())


def test_workload_exercises_sharing_eviction_recycling_retraction_and_aborts():
    engine = SimEngine(SimConfig(seed=2, sliding_window=16, num_slots=512, swa_num_slots=160))
    engine.run(300, SimWorkload(seed=2, abort_prob=0.05))
    assert engine.cache_hit_tokens > 0 and engine.evicted_blocks > 0
    assert engine.retracted > 0 and engine.aborted > 0 and engine.finished > 0
    # sliding window: out-of-window slots of running requests went back to the pool
    assert any(s == 0 for r in engine.running for s in r.swa_slots[r.own_from:])
    # every running request's table and LUT agree with its own slot lists
    for r in engine.running:
        n = r.num_computed
        assert engine.table.req_to_token[r.row, :n].tolist() == r.full_slots[:n]
        assert engine.full_to_swa[r.full_slots[:n]].tolist() == r.swa_slots[:n]


def test_kv_bytes_depend_on_token_position_layer_and_side():
    base = kv_bytes(torch.tensor([5]), torch.tensor([3]), 0, 0, 32)
    for other in (kv_bytes(torch.tensor([6]), torch.tensor([3]), 0, 0, 32),
                  kv_bytes(torch.tensor([5]), torch.tensor([4]), 0, 0, 32),
                  kv_bytes(torch.tensor([5]), torch.tensor([3]), 1, 0, 32),
                  kv_bytes(torch.tensor([5]), torch.tensor([3]), 0, 1, 32)):
        assert not torch.equal(base, other)
    assert torch.equal(base, kv_bytes(torch.tensor([5]), torch.tensor([3]), 0, 0, 32))
