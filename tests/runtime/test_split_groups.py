"""Two canary groups of one kind (``full`` and ``full.1``, as vLLM's hybrid allocator makes when it splits one kind's
layers into two KV cache groups): the groups share launch tags but keep their own slot spaces, records and rings, so
a fault in one is reported against that group (its name in ``Violation.group``) and the right request, with the
other group silent — even when both groups use the very same slot numbers.

Each scenario runs on the runtime's default path and, under ``TRITON_INTERPRET=1``, on the Triton launchers too.
"""
from __future__ import annotations

import pytest
import torch

from kvcanary.engines.sim.engine import kv_bytes
from kvcanary.errors import KvCanaryValueError
from kvcanary.ops import CanaryLaunchTag, FailReason
from kvcanary.runtime import BatchDescription, GroupBatch, GroupSpec, group_kind
from kvcanary.runtime.drain import ring_order
from tests.runtime.conftest import make_canary

GROUPS = ("full", "full.1", "swa")
WINDOW = 4
ROW_BYTES = 32


class SplitEngine:
    """Hand-driven engine with groups ``full`` (layers 0, 2), ``full.1`` (layer 4) and ``swa`` (layers 1, 3; window
    ``WINDOW``). Every group hands out the *same* slot numbers to a request (worst case for telling them apart)."""

    LAYERS = {"full": (0, 2), "full.1": (4,), "swa": (1, 3)}

    def __init__(self, *, num_slots: int = 64, max_requests: int = 4, max_context: int = 64, **options) -> None:
        specs = [GroupSpec(name=n, num_slots=num_slots, layer_ids=self.LAYERS[n],
                           sliding_window=WINDOW if n == "swa" else 0) for n in GROUPS]
        self.canary = make_canary(specs, max_requests=max_requests, max_context=max_context, **options)
        self.tables = {n: torch.zeros(max_requests, max_context, dtype=torch.int32) for n in GROUPS}
        self.tokens = torch.zeros(max_requests, max_context, dtype=torch.int32)
        self.kv = {n: {layer: (torch.zeros(num_slots, ROW_BYTES, dtype=torch.uint8),
                               torch.zeros(num_slots, ROW_BYTES, dtype=torch.uint8)) for layer in self.LAYERS[n]}
                   for n in GROUPS}
        for n in GROUPS:
            self.canary.set_kv_cache(n, self.kv[n])
        self.live: dict[str, set[int]] = {n: set() for n in GROUPS}
        self.canary.set_live_slots_provider(
            lambda: {n: torch.tensor(sorted(s), dtype=torch.int64) for n, s in self.live.items()})

    def batch(self, rows: list[tuple[int, int, list[int], list[int], str]]) -> BatchDescription:
        """``rows``: (table row, prefix, new tokens, their slots, request id) per batch row."""
        ids, pos, loc = [], [], []
        for row, prefix, tokens, slots, _ in rows:
            n = len(tokens)
            for name in GROUPS:
                self.tables[name][row, prefix : prefix + n] = torch.tensor(slots, dtype=torch.int32)
                self.live[name] |= set(slots)
            self.tokens[row, prefix : prefix + n] = torch.tensor(tokens, dtype=torch.int32)
            ids += tokens
            pos += list(range(prefix, prefix + n))
            loc += slots
        loc_t = torch.tensor(loc)
        return BatchDescription(
            req_pool_indices=torch.tensor([r[0] for r in rows]), prefix_lens=torch.tensor([r[1] for r in rows]),
            extend_lens=torch.tensor([len(r[2]) for r in rows]), input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            groups={n: GroupBatch(req_to_token=self.tables[n], out_cache_loc=loc_t) for n in GROUPS},
            request_ids=tuple(r[4] for r in rows), token_table=self.tokens,
            token_table_lens=torch.tensor([r[1] + len(r[2]) for r in rows]),
        )

    def forward(self, rows) -> None:
        batch = self.batch(rows)
        with self.canary.forward(batch):
            for name in GROUPS:
                loc = batch.groups[name].out_cache_loc
                for layer, (k, v) in self.kv[name].items():
                    for side, t in enumerate((k, v)):
                        t[loc] = kv_bytes(batch.input_ids, batch.positions, layer, side, ROW_BYTES)

    def prefill_two(self) -> None:
        """Requests ``a`` (row 1, slots 8..15, decodes from 16) and ``b`` (row 2, slots 30..37, decodes from 38), 8
        tokens each."""
        self.forward([(1, 0, list(range(100, 108)), list(range(8, 16)), "a"),
                      (2, 0, list(range(200, 208)), list(range(30, 38)), "b")])

    def decode_two(self, i: int) -> None:
        self.forward([(1, 8 + i, [108 + i], [16 + i], "a"), (2, 8 + i, [208 + i], [38 + i], "b")])


@pytest.fixture(params=["default", "triton"])
def backend(request):
    if request.param == "triton":
        request.getfixturevalue("all_triton")
    return request.param


def test_group_names_and_kinds():
    names = ("full", "swa", "full.1", "swa.2", "full.10")
    assert [group_kind(n) for n in names] == ["full", "swa", "full", "swa", "full"]
    for bad in ("full.0", "full.01", "full.", "full1", "swa.x", "mla", "", "Full"):
        with pytest.raises(KvCanaryValueError, match=r"^kv-canary: a group name must be"):
            GroupSpec(name=bad, num_slots=8)
    assert GroupSpec(name="full.1", num_slots=8).kind == "full"
    assert GroupSpec(name="swa.1", num_slots=8, sliding_window=4).kind == "swa"
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: GroupSpec 'swa.1' needs sliding_window > 0"):
        GroupSpec(name="swa.1", num_slots=8)
    with pytest.raises(KvCanaryValueError, match=r"^kv-canary: GroupSpec 'full.2' needs sliding_window > 0"):
        GroupSpec(name="full.2", num_slots=8, sliding_window=4)


def test_ring_order_keeps_one_group_per_kind_in_tag_order():
    """One group per kind: the rings stack as the tags do (the common case is unchanged); a second full group's
    rings come right after the first's, each group's HEAD / TAIL / SWEEP adjacent."""
    tags = [t for t in CanaryLaunchTag if not (t.phase == "head" and t.side == "v")]  # the tags groups launch under
    one = [("full" if t.group == "full" else "swa", t) for t in tags]
    assert [t for _, t in ring_order(one)] == sorted(tags)
    two = one + [("full.1", t) for t in tags if t.group == "full"]
    order = ring_order(two)
    head_tail = [CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.TAIL_V_FULL]
    for name in ("full", "full.1"):
        idx = [order.index((name, t)) for t in head_tail]
        assert idx == list(range(idx[0], idx[0] + 3))
    assert order.index(("full.1", CanaryLaunchTag.HEAD_K_FULL)) < order.index(("swa", CanaryLaunchTag.HEAD_K_SWA))


def test_clean_run_is_silent_and_counts_each_forward_once(backend):
    e = SplitEngine()
    e.prefill_two()
    for i in range(6):
        e.decode_two(i)
    assert e.canary.violations() == []
    c = e.canary.counters()
    assert c["total"] == 0 and c["checked_forwards"] == 7 == e.canary.stats().checked_forwards
    report = e.canary.sweep()
    assert report.complete and set(report.verified) == set(GROUPS) and report.verified["full.1"] == 2 * 14
    assert e.canary.violations() == []


def test_flipped_byte_in_the_second_full_group_names_that_group(backend):
    e = SplitEngine()
    e.prefill_two()
    e.decode_two(0)
    e.kv["full.1"][4][1][10, 3] ^= 0x10  # request a's position 2 (slot 10), V of layer 4, group full.1 only
    e.decode_two(1)
    vs = e.canary.violations()
    assert vs and {v.group for v in vs} == {"full.1"}
    v = vs[0]
    assert (v.slot, v.request_id, v.launch_tag, v.reasons) == (
        10, "a", CanaryLaunchTag.TAIL_V_FULL, FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    assert v.stored_fingerprint is not None and v.stored_fingerprint != v.recomputed_fingerprint
    assert "layers [4]" in v.fingerprint_scope  # the fingerprint was read from full.1's sources, not full's
    assert e.canary.counters()["by_tag"] == {"TAIL_V_FULL": len(vs)}


def test_flipped_byte_in_the_first_full_group_names_that_group(backend):
    e = SplitEngine()
    e.prefill_two()
    e.kv["full"][2][0][32, 0] ^= 0x01  # request b's position 2, K of layer 2 (group full)
    e.decode_two(0)
    vs = e.canary.violations()
    assert vs and {(v.group, v.slot, v.request_id) for v in vs} == {("full", 32, "b")}


def test_redirected_read_in_the_second_full_group(backend):
    """Request b's table in full.1 points position 3 at request a's slot: caught in full.1, against b."""
    e = SplitEngine()
    e.prefill_two()
    batch = e.batch([(1, 8, [108], [16], "a"), (2, 8, [208], [38], "b")])
    e.tables["full.1"][2, 3] = 11
    with e.canary.forward(batch):
        pass
    vs = e.canary.violations()
    assert vs and {v.group for v in vs} == {"full.1"}
    head = [v for v in vs if v.phase == "head"]
    assert (11, "b") in {(v.slot, v.request_id) for v in head} and {v.request_id for v in head} == {"b"}


def test_sweep_of_an_idle_slot_in_the_second_full_group(backend):
    """A flipped byte no forward reads: the sweep finds it in full.1 and charges its last writer."""
    e = SplitEngine()
    e.prefill_two()
    e.kv["full.1"][4][0][35, 7] ^= 0x80  # request b's position 5, K of layer 4
    e.forward([(1, 8, [108], [16], "a")])  # b does not run: its slots are idle
    assert e.canary.violations() == []
    e.canary.sweep()
    vs = e.canary.violations()
    assert vs and {(v.group, v.slot, v.request_id, v.phase) for v in vs} == {("full.1", 35, "b", "sweep")}


def test_released_slots_of_one_group_leave_only_that_groups_sweep(backend):
    """Stale sweep rows are judged per group: a slot freed in full.1 (and scribbled on) is no violation, while
    the same slot number, still live in full, stays checked."""
    e = SplitEngine(sweep_interval=1)
    e.prefill_two()
    e.live["full.1"].discard(35)
    e.canary.release_slots("full.1", [35])
    e.kv["full.1"][4][0][35, 7] ^= 0x80
    e.kv["full"][2][0][35, 7] ^= 0x80
    for i in range(3):
        e.forward([(1, 8 + i, [108 + i], [16 + i], "a")])
    vs = e.canary.violations()
    assert vs and {(v.group, v.slot, v.request_id) for v in vs} == {("full", 35, "b")}


def test_moved_records_are_verified_under_the_groups_own_ring(backend):
    """copy_slots on full.1 with a corrupted destination: the MOVE row names full.1."""
    e = SplitEngine()
    e.prefill_two()
    for name in GROUPS:  # the engine copies request a's first two slots to 40, 41 (KV of every group)
        for k, v in e.kv[name].values():
            k[[40, 41]] = k[[8, 9]]
            v[[40, 41]] = v[[8, 9]]
    e.kv["full.1"][4][1][41, 0] ^= 0x02
    report = e.canary.copy_slots("full.1", [8, 9], [40, 41], request_ids=["c"], verify=True)
    assert report.violations and {(v.group, v.slot, v.launch_tag.phase) for v in report.violations} == {
        ("full.1", 41, "move")}
    clean = e.canary.copy_slots("full", [8, 9], [40, 41], request_ids=["c"], verify=True)
    assert clean.violations == ()
