"""`PolledWords`: the views share one buffer, and ``decode`` of its host words gives each view's values."""
from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.polled import PolledWords


@pytest.mark.parametrize("num_tags", [1, 4, 7])
def test_views_share_one_buffer_and_decode_round_trips(num_tags):
    p = PolledWords(num_tags=num_tags, counter_shape=(4, 3), num_groups=2, device=torch.device("cpu"))
    index = torch.tensor([(-1) ** i * (2**31 - 1 - i) if i % 3 else i for i in range(num_tags)], dtype=torch.int32)
    p.write_index.copy_(index)
    p.counters.copy_(torch.arange(12).view(4, 3) * 10**12)
    p.plans_disabled.copy_(torch.tensor([5, -6]))
    for view in (p.write_index, p.counters, p.plans_disabled):
        assert view.untyped_storage().data_ptr() == p.buffer.untyped_storage().data_ptr()
    got_index, got_counters, got_disabled = p.decode(p.buffer.tolist())
    assert got_index == index.tolist()
    assert got_counters == p.counters.flatten().tolist()
    assert got_disabled == [5, -6]
