"""`store_deep_fingerprints`: the deep buffers' records without a chain walk of their own.

* Twin against the op it replaces: after a TAIL write, the stored deep records are the bytes a full write op
  (the torch reference) into the deep buffer stores, when both buffers start in lockstep — on plans as the plan
  op makes them (offsets non-decreasing from 0), with padding, repeated and out-of-range slots, seeds the same
  launch stores (the write op's serial mode) and tokens past the plan's range.
* Triton (interpreter) against the twin: identical bytes, for 1-4 sources of one row shape and of mixed shapes, and
  for strips of 2 to 256 words (LANES tiles with and without masked columns).
* The deep records are LANES-mode fingerprints (`deep_store.DEEP_HASH_MODE`), not ALL-mode ones.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from kvcanary.ops.constants import CANARY_FIELD_REAL_KV_HASH, CanaryLaunchTag, RealKvHashMode
from kvcanary.ops.reference.real_kv import fingerprint_slots
from kvcanary.ops.reference.write import launch_canary_write_kernel_torch_reference
from kvcanary.runtime import deep_store
from kvcanary.runtime.deep_store import store_deep_fingerprints, store_deep_fingerprints_twin

from tests.ops.triton_cases import make_context, make_source, write_inputs, write_plan

FIELDS = 3  # token, position, prev_hash: the chain fields a deep record shares with its TAIL record


def _case(seed: int, *, nsrc: int, same_shape: bool, words: Optional[int] = None):
    """A TAIL write and a deep buffer in lockstep; ``words``: every deep source's strip is that many words."""
    g = torch.Generator().manual_seed(seed)

    def rint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    num_slots = rint(24, 96)
    lengths = [rint(0, 7) for _ in range(rint(1, 6))]
    n_plan = sum(lengths)
    n = n_plan + rint(0, 3)  # tokens past the plan's range are not stored
    loc = torch.randint(1, num_slots, (n,), generator=g)
    loc[torch.rand(n, generator=g) < 0.15] = -1
    if n > 1 and rint(0, 1):
        loc[rint(0, n - 1)] = loc[rint(0, n - 1)]  # a slot written twice
    if n and rint(0, 2) == 0:
        loc[rint(0, n - 1)] = num_slots + rint(0, 3)  # past the buffer
    seeds = [rint(-1, num_slots - 1) for _ in lengths]
    if n and rint(0, 1):
        seeds[rint(0, len(seeds) - 1)] = int(loc[rint(0, n - 1)].clamp(min=1))  # a seed this launch stores
    plan = write_plan(lengths, seeds)
    if rint(0, 3) == 0:
        plan.write_num_valid_reqs[0] = rint(0, len(lengths))  # fewer valid requests than planned rows
    kw = write_inputs(torch.randint(0, 50000, (n,), generator=g).tolist(),
                      torch.randint(0, 64, (n,), generator=g).tolist(), loc.tolist())
    tail_sources = [make_source(g, "cpu", num_slots=num_slots, page_size=4, nbpt=32, read_bytes=32, dtype=torch.bfloat16)]
    tail = make_context(g, "cpu", num_slots=num_slots, stride_bytes=32, ring_cap=64, sources=tail_sources,
                        mode=RealKvHashMode.PARTIAL, chain_assert=0, kind=CanaryLaunchTag.TAIL_K_FULL)
    widths = [[128, 144][rint(0, 1)]] * nsrc if same_shape else [[16, 32, 128, 208][rint(0, 3)] for _ in range(nsrc)]
    if words is not None:
        widths = [8 * words] * nsrc
    deep_sources = [make_source(g, "cpu", num_slots=num_slots, page_size=[1, 4][rint(0, 1)], nbpt=w, read_bytes=w,
                                dtype=torch.bfloat16) for w in widths]
    deep = make_context(g, "cpu", num_slots=num_slots, stride_bytes=32, ring_cap=64, sources=deep_sources,
                        mode=deep_store.DEEP_HASH_MODE, chain_assert=0, kind=CanaryLaunchTag.TAIL_K_FULL)
    # lockstep: the deep buffer holds the TAIL buffer's chain fields (its own REAL_KV words)
    deep.canary_buf.view(torch.int64)[:, :FIELDS] = tail.canary_buf.view(torch.int64)[:, :FIELDS]
    return tail, deep, plan, kw


@pytest.mark.parametrize("seed", range(40))
def test_twin_stores_what_a_full_write_into_the_deep_buffer_stores(seed):
    tail, deep, plan, kw = _case(seed, nsrc=1 + seed % 4, same_shape=seed % 2 == 0)
    launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
    expected = deep.canary_buf.clone()
    launch_canary_write_kernel_torch_reference(context=dataclasses.replace(deep, canary_buf=expected), plan=plan, **kw)
    store_deep_fingerprints_twin(targets=[(tail.canary_buf, deep.canary_buf, deep.real_kv_sources)],
                                 out_loc=kw["out_cache_loc"], plan=plan)
    assert torch.equal(deep.canary_buf, expected)


def test_twin_touches_only_the_stored_slots():
    tail, deep, plan, kw = _case(3, nsrc=2, same_shape=True)
    launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
    before = deep.canary_buf.clone()
    stored = deep_store.stored_entries(plan, kw["out_cache_loc"], tail.canary_buf.shape[0])
    store_deep_fingerprints_twin(targets=[(tail.canary_buf, deep.canary_buf, deep.real_kv_sources)],
                                 out_loc=kw["out_cache_loc"], plan=plan)
    changed = (deep.canary_buf != before).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(kw["out_cache_loc"][stored].tolist())
    assert changed  # the case stores something


@pytest.mark.parametrize("seed,nsrc,same_shape", [(s, 1 + s % 4, s % 3 != 0) for s in range(12)])
def test_triton_matches_the_twin(seed, nsrc, same_shape, monkeypatch):
    tail, deep, plan, kw = _case(100 + seed, nsrc=nsrc, same_shape=same_shape)
    launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
    expected = deep.canary_buf.clone()
    targets = [(tail.canary_buf, expected, deep.real_kv_sources)]
    store_deep_fingerprints_twin(targets=targets, out_loc=kw["out_cache_loc"], plan=plan)
    srcs = deep_store.source_args(deep.real_kv_sources, deep_store.DEEP_HASH_MODE, tail.canary_buf)
    assert srcs is not None
    deep_store._launch(tail.canary_buf, deep.canary_buf, srcs, kw["out_cache_loc"], plan)  # interpreted on the CPU
    assert torch.equal(deep.canary_buf, expected)


@pytest.mark.parametrize("words", [2, 6, 8, 30, 64, 256])
def test_triton_matches_the_twin_for_strip_widths(words):
    """Strips of 2-256 words: LANES tiles of one chunk narrower than, as wide as, or several times the
    tile (columns past the strip masked for 6 and 30 words), pages of 1 or 4 slots, entries not stored."""
    for k, nsrc in enumerate((1, 4)):
        tail, deep, plan, kw = _case(500 + 10 * words + k, nsrc=nsrc, same_shape=True, words=words)
        launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
        expected = deep.canary_buf.clone()
        store_deep_fingerprints_twin(targets=[(tail.canary_buf, expected, deep.real_kv_sources)],
                                     out_loc=kw["out_cache_loc"], plan=plan)
        srcs = deep_store.source_args(deep.real_kv_sources, deep_store.DEEP_HASH_MODE, tail.canary_buf)
        assert srcs.consts["LANES_CH"] == min(1 << (words - 1).bit_length(), 32)
        deep_store._launch(tail.canary_buf, deep.canary_buf, srcs, kw["out_cache_loc"], plan)
        assert torch.equal(deep.canary_buf, expected)


def test_deep_records_hold_lanes_fingerprints():
    """A stored deep record's REAL_KV field is the LANES fingerprint of its sources (not the ALL one)."""
    tail, deep, plan, kw = _case(3, nsrc=3, same_shape=True)
    launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
    store_deep_fingerprints_twin(targets=[(tail.canary_buf, deep.canary_buf, deep.real_kv_sources)],
                                 out_loc=kw["out_cache_loc"], plan=plan)
    slots = kw["out_cache_loc"][deep_store.stored_entries(plan, kw["out_cache_loc"], tail.canary_buf.shape[0])]
    assert slots.numel()
    stored = deep.canary_buf.view(torch.int64)[slots, CANARY_FIELD_REAL_KV_HASH]
    assert deep_store.DEEP_HASH_MODE == RealKvHashMode.LANES
    assert torch.equal(stored, fingerprint_slots(deep.real_kv_sources, RealKvHashMode.LANES, slots, torch.device("cpu")))
    assert not torch.equal(stored, fingerprint_slots(deep.real_kv_sources, RealKvHashMode.ALL, slots, torch.device("cpu")))


def test_nothing_to_store_launches_nothing():
    tail, deep, plan, kw = _case(7, nsrc=1, same_shape=True)
    before = deep.canary_buf.clone()
    store_deep_fingerprints(targets=[], out_loc=kw["out_cache_loc"], plan=plan)
    store_deep_fingerprints(targets=[(tail.canary_buf, deep.canary_buf, deep.real_kv_sources)],
                            out_loc=kw["out_cache_loc"][:0], plan=plan)
    assert torch.equal(deep.canary_buf, before)


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcanary.runtime import deep_store
k = deep_store._deep_store_kernel
assert not deep_store.AVAILABLE or isinstance(k, triton.runtime.jit.JITFunction), type(k)
pointers = {"tail_ptr", "deep_ptr", "slot_ptr", "off_ptr", "s0", "s1", "s2", "s3"}
def shape(widths):  # the launch's own shape (`_launch_shape`: the whole strip per tile, BLOCK tokens to match)
    consts, block = deep_store._launch_shape(dict(NSRC=len(widths), LANES_CH=8,
                                                  **{f"W{i}": w for i, w in enumerate(widths + (2,) * (4 - len(widths)))}))
    return dict(consts, BLOCK=block)
for widths in ((256, 256, 256, 256), (128, 128, 128, 128), (128, 16, 64, 2), (144, 144), (30, 30, 30, 30), (6, 6, 6, 6)):
    # LANES tiles: 2 KiB strips (8B Llama) in one step, mixed widths, masked columns (144, 30 and 6 words)
    consts = shape(widths)
    sig = {a: "constexpr" if a in consts else "*i64" if a in pointers else "*i32" if a == "num_reqs_ptr" else "i64"
           for a in k.arg_names}
    compiled = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": deep_store._WARPS})
    assert compiled.asm["cubin"], widths
k = deep_store._deep_store_kinds_kernel  # buffers' addresses from a device table
consts = shape((256, 256, 256, 256))
sig = {a: "constexpr" if a in consts else "*i32" if a == "num_reqs_ptr" else "*i64" if a.endswith("_ptr") else "i64"
       for a in k.arg_names}
compiled = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": deep_store._WARPS})
assert compiled.asm["cubin"]
print("ok", consts["BLOCK"], consts["LANES_CH"], compiled.metadata.shared)
"""


def test_kernel_compiles_for_hopper():
    """The deep-store kernel builds for sm_90 (PTX and cubin, with the ptxas Triton ships) — CI has no GPU, so the
    interpreter tests above never compile it."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("ok 4 256"), out.stderr[-2000:]


@pytest.mark.parametrize("seed", range(6))
def test_one_launch_per_kind_matches_the_twin_for_many_buffers(seed):
    """Several deep buffers (chunks x sides) of two kinds of sources, each kind in one launch over a table of their
    addresses (interpreted on the CPU): every buffer holds what the twin stores, buffer by buffer."""
    cases = [_case(200 + 10 * seed + k, nsrc=[4, 4, 2, 3][k % 4], same_shape=True) for k in range(5)]
    base = 300 + seed
    while True:  # a plan that stores something in every buffer (each has at least 24 rows)
        plan, kw = _case(base, nsrc=1, same_shape=True)[2:]
        if deep_store.stored_entries(plan, kw["out_cache_loc"].clamp(max=23), 24).any():
            kw["out_cache_loc"] = kw["out_cache_loc"].clamp(max=23)
            break
        base += 100
    launches, expected = [], []
    for tail, deep, _, _ in cases:
        launch_canary_write_kernel_torch_reference(context=tail, plan=plan, **kw)
        want = deep.canary_buf.clone()
        store_deep_fingerprints_twin(targets=[(tail.canary_buf, want, deep.real_kv_sources)],
                                     out_loc=kw["out_cache_loc"], plan=plan)
        expected.append(want)
        launches.append((tail.canary_buf, deep.canary_buf,
                         deep_store.source_args(deep.real_kv_sources, deep_store.DEEP_HASH_MODE, tail.canary_buf)))
    before = [deep.canary_buf.clone() for _, deep, _, _ in cases]
    kinds = deep_store._by_kind(launches)
    assert len(kinds) < len(launches) and sum(map(len, kinds)) == len(launches)
    for group in kinds:
        assert deep_store._launch_kind(group, kw["out_cache_loc"], plan)
    for (_, deep, _, _), want, old in zip(cases, expected, before):
        assert torch.equal(deep.canary_buf, want)
    assert all(not torch.equal(w, o) for w, o in zip(expected, before))  # each buffer stored something


def _every_bit_caught_by_the_sweep(manual, bits):
    """Flip each (layer, side, slot, bit) of ``bits`` in the KV alone, sweep, flip it back: every flip gives sweep rows
    on its slot and side with the real-KV reason only — one from the deep record, plus one from the TAIL record for a
    bit in the 16 bytes its PARTIAL fingerprint reads — and the clean state none."""
    from kvcanary.ops import FailReason

    eng = manual(sweep_interval=0)
    live = {"full": torch.tensor([10, 11, 12])}
    eng.forward(eng.batch(row=1, prefix=0, tokens=[5, 6, 7], slots=[10, 11, 12]))
    eng.canary.sweep(live)
    assert eng.canary.violations() == []
    seen = 0
    for layer, side, slot, bit in bits:
        t = eng.kv[layer][side]
        t[slot, bit // 8] ^= 1 << (bit % 8)
        eng.canary.sweep(live)
        t[slot, bit // 8] ^= 1 << (bit % 8)
        found = eng.canary.violations()[seen:]
        seen += len(found)
        rows = 2 if bit < 8 * 16 else 1
        assert [(v.slot, v.phase, v.launch_tag.side, v.reasons) for v in found] == [
            (slot, "sweep", "kv"[side], FailReason.VERIFY_REAL_KV_HASH_MISMATCH)] * rows, (layer, side, slot, bit)
        if rows == 1:  # past the TAIL's bytes: the deep record's row (the report names the first record that disagrees)
            assert found[0].fingerprint_scope == "layers [0, 1], every byte"
    eng.canary.sweep(live)
    assert len(eng.canary.violations()) == seen


def test_the_sweep_catches_every_single_bit_flip_of_a_deep_source(manual):
    """Every bit of one layer's V strip of a written slot, and every byte (one bit each) of the other layers' and
    sides' strips (twins on the CPU)."""
    every_bit = [(1, 1, 11, bit) for bit in range(8 * 32)]
    every_byte = [(layer, side, 11, 8 * byte + byte % 8) for layer, side in ((0, 0), (0, 1), (1, 0)) for byte in range(32)]
    _every_bit_caught_by_the_sweep(manual, every_bit + every_byte)


@pytest.mark.usefixtures("all_triton")
def test_the_sweep_catches_single_bit_flips_on_the_triton_kernels(manual):
    """The same on the Triton launchers (interpreted): a seeded sample of bits over every layer, side and slot."""
    g = torch.Generator().manual_seed(5)
    bits = [(int(torch.randint(0, 2, (1,), generator=g)), int(torch.randint(0, 2, (1,), generator=g)),
             10 + int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(0, 256, (1,), generator=g)))
            for _ in range(24)]
    _every_bit_caught_by_the_sweep(manual, bits + [(0, 0, 10, 0), (1, 1, 12, 255)])
