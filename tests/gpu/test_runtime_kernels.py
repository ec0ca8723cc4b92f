"""The fused runtime kernels (`kvcanary.runtime.kernels`) on a real CUDA device, against their torch twins
run on the same device, bit for bit:

* launchers at sizes the interpreter tests cannot afford (a 4k-entry slice over 270k slots; 60k tokens
  whose slots repeat heavily, so the claim atomics really race);
* captured in a CUDA graph and replayed (the records' epoch and the sweep cursor advance on the device);
* the simulated runtime (full + sliding-window groups, rotating sweep) on the kernels vs on the twins.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload  # noqa: E402
from kvcanary.ops.dispatch import selected_backend  # noqa: E402
from kvcanary.runtime import Canary, CanaryConfig, kernels  # noqa: E402
from tests.runtime.kernel_cases import (  # noqa: E402
    SweepState,
    assert_same,
    chained_records,
    random_offsets,
    random_records,
    random_write,
    records_like,
    records_state,
)

DEV = "cuda"


@pytest.mark.parametrize("bs", [0, 1, 64, 1000])
def test_token_rows_cuda(bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    offsets = random_offsets(gen, bs, bs + 8).to(DEV)
    n = int(offsets[bs]) + 300
    got = kernels.launch_token_rows(offsets, bs, n)
    want = kernels.token_rows_twin(offsets, bs, n, torch.arange(n, device=DEV))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("seed", range(3))
def test_record_write_cuda_heavy_duplicates(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_slots = 3000  # 60k tokens over ~1k slots: ~60 writers per slot
    twin = random_records(gen, num_slots, DEV)
    fused = records_like(twin, DEV)
    for step, rows, n, max_len in [(1, 200, 60_000, 600), (1, 7, 5000, 5), (2, 3000, 20_000, 8)]:
        write = random_write(gen, num_slots, rows, n, step, device=DEV, max_len=max_len)
        if max_len == 600:
            assert int(write["valid"].sum()) > 30_000  # tens of thousands of claims on ~1k slots
        kernels.record_write_twin(twin, **write)
        kernels.launch_record_write(fused, **write)
        assert_same(records_state(fused), records_state(twin))


def test_sweep_slice_cuda_large() -> None:
    gen = torch.Generator().manual_seed(3)
    num_slots, interval = 272_000, 64
    rec = chained_records(gen, num_slots, DEV)
    size = -(-num_slots // interval)
    live = (torch.rand(num_slots + 1, generator=gen) < 0.8).to(DEV)
    live[0] = live[-1] = False
    offsets = torch.arange(size, device=DEV)
    twin, fused = SweepState(size, DEV), SweepState(size, DEV)
    for k in range(interval + 3):
        common = dict(records=rec, live_mask=live, offsets=offsets, span=size * interval,
                      step=torch.tensor([k], device=DEV))
        kernels.sweep_slice_twin(**common, **twin.args())
        kernels.launch_sweep_slice(**common, **fused.launch_args())
        assert_same(fused.snapshot(), twin.snapshot())


def test_kernels_captured_in_a_graph() -> None:
    """Record writes and sweep slices captured once, replayed with new inputs each time (steps repeating
    across replays) == the twins run eagerly on the same inputs."""
    gen = torch.Generator().manual_seed(9)
    num_slots, n, size = 4096, 3000, 700
    rec = random_records(gen, num_slots, DEV)
    twin_rec = records_like(rec, DEV)
    static = random_write(gen, num_slots, 40, n, 1, device=DEV)
    live = (torch.rand(num_slots + 1, generator=gen) < 0.8).to(DEV)
    live[0] = live[-1] = False
    sweep_args = dict(live_mask=live, offsets=torch.arange(size, device=DEV), span=size * 6, step=static["step"])
    sweep, twin_sweep = SweepState(size, DEV), SweepState(size, DEV)

    def work() -> None:
        kernels.launch_record_write(rec, **static)
        kernels.launch_sweep_slice(records=rec, **sweep_args, **sweep.launch_args())

    def twin_work() -> None:
        kernels.record_write_twin(twin_rec, **static)
        kernels.sweep_slice_twin(records=twin_rec, **sweep_args, **twin_sweep.args())

    work()  # compiles outside capture
    twin_work()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    for i in range(8):
        fresh = random_write(gen, num_slots, 40, n, 2 + i // 3, device=DEV)
        for k, v in fresh.items():
            if isinstance(v, torch.Tensor):
                static[k].copy_(v)
        graph.replay()
        twin_work()
        assert_same(records_state(rec), records_state(twin_rec))
        assert_same(sweep.snapshot(), twin_sweep.snapshot())


def _sim_state():
    sc = SimConfig(num_slots=2048, swa_num_slots=512, sliding_window=24, max_requests=24, max_context=256,
                   chunk_size=48, max_batch_tokens=192, max_running=12, block_size=4, seed=5, device=DEV)
    canary = Canary(CanaryConfig(sweep_interval=16, health_interval=0, readable_per_step=0, chain_position_warmup=0),
                    groups=sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                    max_batch_tokens=sc.max_batch_tokens, device=DEV)
    engine = SimEngine(sc, canary)
    engine.run(80, SimWorkload(seed=5, new_tokens=(20, 60), abort_prob=0.0, arrival_prob=0.5))
    out = {}
    for name, g in canary.groups.items():
        out.update({f"{name}.{k}": v for k, v in records_state(g.records).items()})
        out.update({f"{name}.{b}": t.cpu() for b, t in zip(("head", *g.tail_bufs), (g.head_buf, *g.tail_bufs.values()))})
        out.update({f"{name}.deep{c}{side}": t.cpu() for (c, side), t in g.deep_bufs.items()})
    for name, sl in canary.sweeper._slices.items():
        out.update({f"{name}.history": sl.owner_history.cpu(), f"{name}.cursor": sl.cursor.cpu(),
                    f"{name}.verified": sl.verified.cpu(), f"{name}.last_pass": sl.last_pass.cpu()})
    return out, canary.stats().violations


def test_runtime_on_kernels_matches_twins() -> None:
    """The simulated runtime on the Triton launchers, then on the twins everywhere (`selected_backend("torch")`:
    ops, runtime glue and deep store): the same state, no violations."""
    assert kernels.use_kernels(torch.zeros(1, device=DEV))
    fused_state, fused_violations = _sim_state()
    assert any(k.startswith("full.deep") for k in fused_state)  # deep fingerprints on (the default)
    with selected_backend("torch"):
        assert not kernels.use_kernels(torch.zeros(1, device=DEV))
        twin_state, twin_violations = _sim_state()
    assert_same(fused_state, twin_state)
    assert fused_violations == twin_violations == 0
