"""Fixtures for runtime tests: a canary factory, the simulated engine, and a hand-driven engine
for exact single-request scenarios."""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvcanary.engines.sim import SimConfig, SimEngine, SimWorkload
from kvcanary.engines.sim.engine import kv_bytes
from kvcanary.runtime import BatchDescription, Canary, CanaryConfig, GroupBatch, GroupSpec

QUIET = dict(health_interval=0, stats_interval=0, readable_per_step=0)


@pytest.fixture
def all_triton():
    """Ops and runtime glue on the Triton launchers for CPU tensors (the interpreter runs them; needs
    ``TRITON_INTERPRET=1`` set before Triton was imported): ``dispatch.selected_backend("triton")``."""
    from kvcanary.ops.dispatch import selected_backend
    from tests.ops.test_triton_interpret import _numpy_scalar_index_fix

    _numpy_scalar_index_fix()
    with selected_backend("triton"):
        yield


def make_canary(specs, *, max_requests=32, max_context=256, max_batch_tokens=256, **options) -> Canary:
    config = CanaryConfig(**{**QUIET, "chain_position_warmup": 0, "sweep_interval": 0, **options})
    return Canary(config, groups=specs, max_requests=max_requests, max_context=max_context,
                  max_batch_tokens=max_batch_tokens)


def make_sim(*, canary_options=None, **sim_options) -> tuple[SimEngine, Canary]:
    sc = SimConfig(**sim_options)
    canary = make_canary(sc.group_specs(), max_requests=sc.max_requests, max_context=sc.max_context,
                         **(canary_options or {}))
    return SimEngine(sc, canary), canary


def warm_sim(engine: SimEngine, steps: int = 40, seed: int = 0) -> None:
    """Run the engine with a workload whose requests live long enough to be caught mid-flight."""
    engine.run(steps, SimWorkload(seed=seed, new_tokens=(30, 60), abort_prob=0.0, arrival_prob=0.5))


class ManualEngine:
    """One full-attention group, two layers, slots handed out by the test: exact scenarios."""

    def __init__(self, canary: Canary, num_slots: int = 64, max_requests: int = 4, max_context: int = 64) -> None:
        self.canary = canary
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int32)
        self.tokens = torch.zeros(max_requests, max_context, dtype=torch.int32)
        self.kv = {layer: (torch.zeros(num_slots, 32, dtype=torch.uint8), torch.zeros(num_slots, 32, dtype=torch.uint8))
                   for layer in (0, 1)}
        canary.set_kv_cache("full", self.kv)

    def batch(self, row: int, prefix: int, tokens: list[int], slots: list[int], rid: str = "req") -> BatchDescription:
        n = len(tokens)
        self.table[row, prefix : prefix + n] = torch.tensor(slots, dtype=torch.int32)
        self.tokens[row, prefix : prefix + n] = torch.tensor(tokens, dtype=torch.int32)
        return BatchDescription(
            req_pool_indices=torch.tensor([row]), prefix_lens=torch.tensor([prefix]), extend_lens=torch.tensor([n]),
            input_ids=torch.tensor(tokens), positions=torch.arange(prefix, prefix + n),
            groups={"full": GroupBatch(req_to_token=self.table, out_cache_loc=torch.tensor(slots))},
            request_ids=(rid,), token_table=self.tokens, token_table_lens=torch.tensor([prefix + n]),
            forward_kind="prefill" if prefix == 0 else "decode",
        )

    def forward(self, batch: BatchDescription) -> None:
        with self.canary.forward(batch):
            self.store(batch)

    def store(self, batch: BatchDescription) -> None:
        loc = batch.groups["full"].out_cache_loc
        for layer, (k, v) in self.kv.items():
            for side, t in enumerate((k, v)):
                t[loc] = kv_bytes(batch.input_ids, batch.positions, layer, side, 32)


@pytest.fixture
def full_spec():
    return [GroupSpec(name="full", num_slots=64, layer_ids=(0, 1))]


@pytest.fixture
def manual(full_spec):
    def build(**options) -> ManualEngine:
        return ManualEngine(make_canary(full_spec, max_requests=4, max_context=64, **options))

    return build


def flip_and_redirect(engine: SimEngine) -> None:
    """Two faults on running requests: a flipped V bit in one's cached KV, a redirected read in another's."""
    from kvcanary.faults.sim_hooks import flip_kv_bit, redirect_slot

    victim = next(r for r in engine.running if r.num_computed > 8)
    flip_kv_bit(engine, "full", victim.full_slots[2], side="v", byte=1, bit=3)
    other = next(r for r in engine.running if r is not victim and r.num_computed > 8)
    redirect_slot(engine, other.rid, 4, victim.full_slots[5])


class CountTorchCalls(TorchFunctionMode):
    """Counts torch calls made inside it (``n``): a stand-in for per-forward host work."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))
