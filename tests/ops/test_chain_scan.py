"""The write chain's serial scan: compiled and pure-Python loops give the same bits."""
import pytest
import torch

from kvcanary.ops.hashing import splitmix64_mix3, to_signed64
from kvcanary.ops.reference import chain_scan


def _expected(start, lengths, tokens, positions):
    out, i = [], 0
    for h, n in zip(start, lengths):
        for _ in range(n):
            out.append(to_signed64(h))
            h = splitmix64_mix3(h, tokens[i], positions[i])
            i += 1
    return out


@pytest.mark.parametrize("compiled", [True, False])
def test_scan_matches_definition(compiled):
    if compiled:
        pytest.importorskip("numba")
        assert chain_scan.compiled_scan() is not None
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([0, 1, 5, 0, 17, 3])
    n = int(lengths.sum())
    start = torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen)
    tokens = torch.randint(-(2**40), 2**40, (n,), generator=gen)
    positions = torch.randint(-5, 1 << 20, (n,), generator=gen)
    got = chain_scan.chain_scan(start, lengths, tokens, positions, compiled=compiled)
    assert got.tolist() == _expected(start.tolist(), lengths.tolist(), tokens.tolist(), positions.tolist())


def test_scan_empty():
    assert chain_scan.chain_scan(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                                 torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_python_loop_forces_the_python_loop_inside_the_block_only():
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([4, 0, 9])
    start = torch.randint(-(2**63), 2**63 - 1, (3,), generator=gen)
    tokens, positions = torch.randint(0, 1 << 30, (2, 13), generator=gen)
    want = _expected(start.tolist(), lengths.tolist(), tokens.tolist(), positions.tolist())
    with pytest.raises(RuntimeError):
        with chain_scan.python_loop():
            assert chain_scan._python_only
            assert chain_scan.chain_scan(start, lengths, tokens, positions).tolist() == want
            raise RuntimeError("the switch is restored on the way out")
    assert not chain_scan._python_only
    assert chain_scan.chain_scan(start, lengths, tokens, positions).tolist() == want
