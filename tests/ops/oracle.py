"""A tiny scalar oracle of the canary ops, written straight from docs/design.md §3 with Python ints and loops.

It is deliberately slow and obvious and shares no code with ``kvcanary.ops`` except the constants
and enums. Every function works on plain Python values (lists of ints, bytes) taken from copies of
the tensors, and returns the fields the op must leave behind:

* ``OracleCanary`` — snapshot of a VerifyOrWriteContext's mutable state (records, ring, index,
  counters) plus what the oracle needs to fingerprint slots (source bytes, mode, kind).
* ``oracle_write`` / ``oracle_verify`` mutate an ``OracleCanary`` like the ops do.
* ``oracle_plan`` returns the nine plan outputs from their old values.
* ``oracle_scatter`` returns the expected-token table as nested lists.
* ``assert_context_matches`` compares a real context with an ``OracleCanary`` field for field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from kvcanary.ops.constants import (
    CANARY_CHAIN_ANCHOR,
    FailReason,
    RealKvHashMode,
)

M64 = (1 << 64) - 1


# --------------------------------------------------------------------------- hashes (§3.2)
def u64(x: int) -> int:
    return x & M64


def s64(x: int) -> int:
    x &= M64
    return x - (1 << 64) if x >> 63 else x


def sm64(x: int) -> int:
    x = u64(x)
    x = u64((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9)
    x = u64((x ^ (x >> 27)) * 0x94D049BB133111EB)
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    h = sm64(a)
    h = sm64(h ^ u64(b))
    return sm64(h ^ u64(c))


H0 = sm64(CANARY_CHAIN_ANCHOR)


# --------------------------------------------------------------------------- real-KV bytes (§3.3)
@dataclass
class OracleSource:
    rows: list  # list[bytes]: each row's logical bytes, in logical order
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    @classmethod
    def of(cls, src) -> "OracleSource":
        t = src.tensor
        mat = t.contiguous().reshape(t.shape[0], -1)
        rows = [bytes(mat[r].contiguous().view(torch.uint8).tolist()) for r in range(mat.shape[0])]
        return cls(rows, src.page_size, src.num_bytes_per_token, src.read_bytes)


LANES_KEY = 0x9E3779B97F4A7C15  # LANES mode: word i is keyed with (i + 1) * LANES_KEY (docs/design.md §3.2)


def fingerprint(sources: Sequence[OracleSource], mode: int, slot: int) -> int:
    """Real-KV fingerprint (signed int64 value) of one slot. LANES: each source's acc is the sum mod 2^64 of
    ``sm64(w_i ^ (i + 1) * LANES_KEY)``; the sources combine as in ALL."""
    if int(mode) == RealKvHashMode.NONE or not sources:
        return 0
    total = 0
    for src in sources:
        n = 16 if int(mode) == RealKvHashMode.PARTIAL else src.read_bytes
        row = src.rows[slot // src.page_size]
        col = (slot % src.page_size) * src.num_bytes_per_token
        strip = row[col : col + n]
        assert len(strip) == n
        acc = 0
        for k in range(0, n, 8):
            w = int.from_bytes(strip[k : k + 8], "little")
            if int(mode) == RealKvHashMode.LANES:
                acc = u64(acc + sm64(w ^ u64((k // 8 + 1) * LANES_KEY)))
            else:
                acc = sm64(acc ^ w)
        total = sm64(total ^ acc)
    return s64(total)


# --------------------------------------------------------------------------- canary state
@dataclass
class OracleCanary:
    records: list  # list[list[int]]: [token, position, prev_hash, real_kv_hash] as signed int64
    ring: list  # list[list[int]]
    write_index: int
    slot_run_counter: int
    kernel_run_counter: int
    kind: int
    mode: int
    sources: list = field(default_factory=list)
    chain_assert: int = 0

    @classmethod
    def of(cls, ctx) -> "OracleCanary":
        fields = ctx.canary_buf.clone().view(torch.int64)[:, :4]
        return cls(
            records=[list(map(int, r)) for r in fields.tolist()],
            ring=[list(map(int, r)) for r in ctx.violation_ring.tolist()],
            write_index=int(ctx.violation_write_index[0]),
            slot_run_counter=int(ctx.slot_run_counter[0]),
            kernel_run_counter=int(ctx.kernel_run_counter[0]),
            kind=int(ctx.kernel_kind),
            mode=int(ctx.real_kv_hash_mode),
            sources=[OracleSource.of(s) for s in ctx.real_kv_sources],
            chain_assert=int(ctx.enable_chain_position_assert[0]),
        )

    def slot_hash(self, s: int) -> int:
        if s < 0:
            return s64(H0)
        tok, pos, prev, _ = self.records[s]
        return s64(mix3(prev, tok, pos))

    def append(self, rows: list) -> None:
        """§3.4: rows go to [base, min(base + k, cap)); the index grows by k."""
        base = self.write_index
        for j, row in enumerate(rows):
            if 0 <= base + j < len(self.ring):
                self.ring[base + j] = [s64(v) for v in row]
        self.write_index += len(rows)


def push_records(ctx, st: OracleCanary) -> None:
    """Store the oracle's records into the context's canary buffer (first 32 bytes of each row)."""
    ctx.canary_buf.view(torch.int64)[:, :4] = torch.tensor(st.records, dtype=torch.int64).reshape(-1, 4)


def assert_context_matches(ctx, want: OracleCanary, buf_before: torch.Tensor) -> None:
    """The context's buffer, ring, index and counters equal the oracle's; bytes past 32 untouched."""
    fields = ctx.canary_buf.view(torch.int64)
    got_records = [list(map(int, r)) for r in fields[:, :4].tolist()]
    for s, (g, w) in enumerate(zip(got_records, want.records)):
        assert g == w, f"slot {s}: got {g}, want {w}"
    assert torch.equal(ctx.canary_buf[:, 32:], buf_before[:, 32:]), "bytes past 32 were touched"
    got_ring = [list(map(int, r)) for r in ctx.violation_ring.tolist()]
    assert got_ring == want.ring
    assert int(ctx.violation_write_index[0]) == want.write_index
    assert int(ctx.slot_run_counter[0]) == want.slot_run_counter
    assert int(ctx.kernel_run_counter[0]) == want.kernel_run_counter


# --------------------------------------------------------------------------- write (§3.6)
def oracle_write(
    st: OracleCanary,
    *,
    offsets: list,
    seeds: list,
    num_valid_reqs: int,
    input_ids: list,
    positions: list,
    out_cache_loc: list,
    input_assert: bool,
    expected_tokens: Optional[list],
    expected_positions: Optional[list],
) -> None:
    st.kernel_run_counter += 1
    a = min(max(num_valid_reqs, 0), len(seeds))
    if not (a > 0 and offsets[a] > 0):
        return
    rows = []
    written = 0
    W_POS = int(FailReason.WRITE_POSITION_MISMATCH)
    W_TOK = int(FailReason.WRITE_TOKEN_MISMATCH)
    for r in range(a):
        seed = seeds[r]
        running = st.slot_hash(seed)
        assert_on = seed >= 0 and st.chain_assert != 0
        last_pos = st.records[seed][1] if assert_on else None
        for i in range(offsets[r], offsets[r + 1]):
            slot = out_cache_loc[i]
            if slot < 0:
                continue
            tok, pos = input_ids[i], positions[i]
            fp = fingerprint(st.sources, st.mode, slot)
            if input_assert:
                bits = 0
                if tok != expected_tokens[i]:
                    bits |= W_TOK
                if pos != expected_positions[i]:
                    bits |= W_POS
                if bits:
                    rows.append([st.kind, slot, pos, tok, expected_tokens[i], running, expected_positions[i], bits])
            if assert_on:
                want_pos = s64(last_pos + 1)
                if pos != want_pos:
                    rows.append([st.kind, slot, pos, tok, tok, running, want_pos, W_POS])
                last_pos = pos
            st.records[slot] = [tok, pos, running, fp]
            running = s64(mix3(running, tok, pos))
            written += 1
    st.slot_run_counter += written
    st.append(rows)


# --------------------------------------------------------------------------- verify (§3.7)
def oracle_verify(
    st: OracleCanary,
    *,
    slots: list,
    expected_tokens: list,
    expected_positions: list,
    prev_slots: list,
    num_valid: int,
    enable: int,
    check_token: bool,
) -> None:
    st.kernel_run_counter += 1
    if enable == 0:
        return
    active = min(max(num_valid, 0), len(slots))
    st.slot_run_counter += active
    if not any(slots[i] != 0 for i in range(active)):
        return
    rows = []
    for i in range(active):
        slot = slots[i]
        if slot == 0:
            continue
        tok, pos, prev_hash, kv = st.records[slot]
        prev = prev_slots[i]
        reachable = prev != 0
        expected_chain = st.slot_hash(prev) if reachable else prev_hash
        exp_tok = expected_tokens[i] if check_token else -1
        bits = 0
        if reachable and prev_hash != expected_chain:
            bits |= int(FailReason.VERIFY_CHAIN_HASH_MISMATCH)
        if check_token and exp_tok != -1 and tok != exp_tok:
            bits |= int(FailReason.VERIFY_TOKEN_MISMATCH)
        if pos != expected_positions[i]:
            bits |= int(FailReason.VERIFY_POSITION_MISMATCH)
        if kv != fingerprint(st.sources, st.mode, slot):
            bits |= int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
        if bits:
            rows.append([st.kind, slot, pos, tok, exp_tok, prev_hash, expected_chain, bits])
    st.append(rows)


# --------------------------------------------------------------------------- plan (§3.5)
@dataclass
class OraclePlanOut:
    verify_slot_indices: list
    verify_expected_tokens: list
    verify_expected_positions: list
    verify_prev_slot_indices: list
    verify_num_valid: int
    enable: int
    write_offsets: list
    write_seed_slot_indices: list
    write_num_valid_reqs: int

    @classmethod
    def of(cls, vplan, wplan) -> "OraclePlanOut":
        return cls(
            vplan.verify_slot_indices.tolist(), vplan.verify_expected_tokens.tolist(),
            vplan.verify_expected_positions.tolist(), vplan.verify_prev_slot_indices.tolist(),
            int(vplan.verify_num_valid[0]), int(vplan.enable[0]),
            wplan.write_offsets.tolist(), wplan.write_seed_slot_indices.tolist(),
            int(wplan.write_num_valid_reqs[0]),
        )


def oracle_plan(
    old: OraclePlanOut,
    *,
    req_pool_indices: list,
    prefix_lens: list,
    extend_seq_lens: list,
    req_to_token: list,
    swa_window_size: int,
    lut: Optional[list],
    verify_capacity: int,
    table: Optional[list],
    valid_lens: Optional[list],
    offset: int,
) -> OraclePlanOut:
    """The nine plan outputs; raises ValueError (twin's messages) exactly where the twin must."""
    name = "launch_canary_plan_kernels_torch_reference"
    if verify_capacity != len(old.verify_slot_indices):
        raise ValueError(
            f"kv-canary: {name} verify_capacity={verify_capacity} does not match "
            f"verify_plan_out.verify_slot_indices.shape[0]={len(old.verify_slot_indices)}"
        )
    if table is not None and valid_lens is None:
        raise ValueError(
            f"kv-canary: {name} requires req_to_verify_expected_tokens_valid_lens when "
            "req_to_verify_expected_tokens is set"
        )

    def T(x: int) -> int:
        if lut is None or x < 0:
            return x
        if x >= len(lut):
            raise ValueError(f"kv-canary: SWA slot {x} is outside full_to_swa_index_mapping length {len(lut)}")
        return lut[x]

    W = swa_window_size
    bs = len(req_pool_indices)
    entries = []  # (slot, expected_token, expected_position, prev)
    for r in range(bs):
        rp, P = req_pool_indices[r], prefix_lens[r]
        if rp == 0:
            continue
        lo = max(0, P - W) if W > 0 else 0
        for pos in range(lo, P):
            slot = T(req_to_token[rp][pos])
            prev = T(req_to_token[rp][pos - 1]) if pos > 0 else -1
            tok = -1
            if table is not None and 0 <= pos + offset < valid_lens[r]:
                tok = table[rp][pos + offset]
            entries.append((slot, tok, pos, prev))

    new = OraclePlanOut(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(old).items()})
    total = len(entries)
    if total > verify_capacity:
        new.verify_num_valid = verify_capacity
        new.enable = 0
    else:
        for i, (slot, tok, pos, prev) in enumerate(entries):
            new.verify_slot_indices[i] = slot
            new.verify_expected_tokens[i] = tok
            new.verify_expected_positions[i] = pos
            new.verify_prev_slot_indices[i] = prev
        new.verify_num_valid = total
        new.enable = 1

    seq = [0]
    for r in range(bs):
        E = extend_seq_lens[r]
        seq.append(seq[-1] + (E if req_pool_indices[r] != 0 and E > 0 else 0))
    n_off = len(new.write_offsets)
    for i in range(n_off):
        new.write_offsets[i] = seq[i] if i < len(seq) else 0

    for r in range(min(bs, len(new.write_seed_slot_indices))):
        rp, P, E = req_pool_indices[r], prefix_lens[r], extend_seq_lens[r]
        if rp == 0 or E <= 0 or P <= 0:
            new.write_seed_slot_indices[r] = -1
        else:
            new.write_seed_slot_indices[r] = T(req_to_token[rp][P - 1])
    new.write_num_valid_reqs = bs
    return new


# --------------------------------------------------------------------------- scatter (§3.8)
def oracle_scatter(pool: list, *, flat_in: list, offsets: list, req_pool_indices: list) -> list:
    pool = [list(row) for row in pool]
    width = len(pool[0]) if pool else 0
    for r, rp in enumerate(req_pool_indices):
        n = min(offsets[r + 1] - offsets[r], width)
        for j in range(max(n, 0)):
            v = flat_in[offsets[r] + j] & 0xFFFFFFFF
            pool[rp][j] = v - (1 << 32) if v >> 31 else v
    return pool
