"""`StaticBatch`: the host-upload route (pinned mirrors + one upload; forced on the CPU here) leaves the
device buffers exactly as the device-copy route does, padding included, over batches that grow, shrink,
change shape and gain context keys and shared lengths; and it costs the same torch calls whatever the batch size."""
from __future__ import annotations

import random

import pytest
import torch

from kvcanary.runtime import BatchDescription, GroupBatch
from kvcanary.runtime.staging import StaticBatch

from tests.runtime.conftest import CountTorchCalls

GROUPS = ("full", "swa")
TABLE = torch.zeros(9, 64, dtype=torch.int32)
LUT = torch.arange(512, dtype=torch.int64)
TOKENS = torch.zeros(9, 64, dtype=torch.int32)


def _batch(rng: random.Random, bs: int, *, oracle: bool, context: bool, short_loc: bool, dtype=torch.int64,
           shared: bool = False):
    ext = [rng.randint(1, 5) for _ in range(bs)]
    n = sum(ext)

    def col(k: int) -> torch.Tensor:
        return torch.tensor([rng.randint(1, 1000) for _ in range(k)], dtype=dtype)

    loc_n = max(0, n - 2) if short_loc else n
    return BatchDescription(
        req_pool_indices=torch.tensor([rng.randint(1, 8) for _ in range(bs)], dtype=dtype),
        prefix_lens=col(bs), extend_lens=torch.tensor(ext, dtype=dtype), input_ids=col(n), positions=col(n),
        groups={"full": GroupBatch(req_to_token=TABLE, out_cache_loc=col(n)),
                "swa": GroupBatch(req_to_token=TABLE, out_cache_loc=col(loc_n), full_to_group_lut=LUT)},
        request_ids=tuple(f"r{i}" for i in range(bs)), token_table=TOKENS, token_table_lens=col(bs),
        expected_input_ids=col(n) if oracle else None, context_keys=col(bs) if context else None,
        shared_lens=col(bs) if shared else None,
    )


def _used(s: StaticBatch, batch: BatchDescription) -> dict[str, torch.Tensor]:
    """Every buffer the launches read for ``batch``, whole (padding included)."""
    out = {"rows": s.rows, "prefix": s.prefix, "extend": s.extend, "input_ids": s.input_ids, "positions": s.positions,
           "token_lens": s.token_lens[: batch.batch_size], **{f"out_loc:{g}": t for g, t in s.out_loc.items()}}
    if s.has_context:
        out["context_keys"] = s.context_keys
    if s.has_shared:
        out["shared"] = s.shared
    if batch.expected_input_ids is not None:
        out["expected_ids"] = s.expected_ids[: batch.num_tokens]
    return {k: v.clone() for k, v in out.items()}


@pytest.mark.parametrize("seed,rows,tokens,small", [(0, 8, 16, 256), (1, 8, 16, 256), (2, 8, 16, 256),
                                                     (3, 4, 32, 8), (4, 4, 32, 8), (5, 8, 64, 8)])
def test_host_upload_matches_device_copies_padding_included(seed, rows, tokens, small):
    """``small`` < ``tokens`` (rows within it): batches of at most ``small`` tokens go to the decode-sized set,
    the rest to the full one, back and forth; both routes leave the active set's views identical."""
    rng = random.Random(seed)
    kw = dict(groups=GROUPS, max_rows=rows, max_tokens=tokens, device=torch.device("cpu"), small_tokens=small)
    copies = StaticBatch(**kw, host_upload=False)
    upload = StaticBatch(**kw, host_upload=True)
    used = set()
    for i in range(40):
        bs = rng.choice([1, 1, 2, 5, 8, 12])  # 12 rows (up to 60 tokens) grows both
        batch = _batch(rng, bs, oracle=rng.random() < 0.5, context=i >= 20 and rng.random() < 0.7,
                       short_loc=rng.random() < 0.3, dtype=rng.choice([torch.int32, torch.int64]),
                       shared=i >= 10 and rng.random() < 0.5)
        copies.stage(batch)
        upload.stage(batch)
        if batch.shared_lens is None:  # once seen, staged every step: all padding (0) in a step without shares
            assert not upload.has_shared or not upload.shared.any()
        assert copies.active == upload.active == ("small" if "small" in upload.sets and batch.num_tokens <= small
                                                  else "full")
        used.add(upload.active)
        a, b = _used(copies, batch), _used(upload, batch)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (i, name, a[name], b[name])
        assert (copies.num_rows, copies.num_tokens) == (upload.num_rows, upload.num_tokens) == (bs, batch.num_tokens)
    assert upload.growths == copies.growths >= 1
    if small < tokens:
        assert used == {"small", "full"}


def test_host_upload_costs_the_same_torch_calls_for_any_batch_size():
    rng = random.Random(5)
    counts = []
    for bs in (2, 64):
        s = StaticBatch(groups=GROUPS, max_rows=64, max_tokens=512, device=torch.device("cpu"), host_upload=True)
        batch = _batch(rng, bs, oracle=True, context=False, short_loc=False)
        s.stage(batch)  # first stage of this shape: builds the mirror plan
        with CountTorchCalls() as calls:
            s.stage(batch)
        counts.append(calls.n)
    assert counts[0] == counts[1], counts


def test_fresh_mirror_pads_what_the_device_never_held():
    s = StaticBatch(groups=GROUPS, max_rows=4, max_tokens=8, device=torch.device("cpu"), host_upload=True)
    rng = random.Random(9)
    s.stage(_batch(rng, 1, oracle=False, context=False, short_loc=False))
    assert torch.all(s.rows[1:] == 0) and torch.all(s.out_loc["full"][s.num_tokens:] == -1)
    assert torch.all(s.out_loc["swa"][s.num_tokens:] == -1)


def test_decode_sized_set_holds_only_small_token_capacities():
    s = StaticBatch(groups=GROUPS, max_rows=64, max_tokens=8192, device=torch.device("cpu"), host_upload=True)
    assert set(s.sets) == {"full", "small"}
    small, full = s.sets["small"].packed.numel(), s.sets["full"].packed.numel()
    assert small == 6 * 64 + 5 * 256 and full == 6 * 64 + 5 * 8192  # 6 row fields, then 3 token fields + 2 out_loc
    s.stage(_batch(random.Random(1), 64, oracle=True, context=False, short_loc=False))  # <= 320 tokens
    assert s.active == ("small" if s.num_tokens <= 256 else "full")
    assert s.input_ids.data_ptr() == s.sets[s.active].views["input_ids"].data_ptr()
    s.stage(_batch(random.Random(2), 8, oracle=True, context=False, short_loc=False))  # <= 40 tokens
    assert s.active == "small" and s.input_ids.data_ptr() == s.sets["small"].packed[6 * 64 :].data_ptr()
    wide = StaticBatch(groups=GROUPS, max_rows=512, max_tokens=8192, device=torch.device("cpu"))
    assert set(wide.sets) == {"full"}  # rows past the decode bucket: no small set
