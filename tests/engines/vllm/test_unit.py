"""vLLM adapter pieces that need no engine: version pin, KV layout probe and views, config, metrics merge.

Runs in the vLLM venv (scripts/setup_vllm.sh); skipped where vllm is not installed.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from kvcanary.engines.vllm import (  # noqa: E402
    CONNECTOR_NAME,
    FAULT_CONNECTOR_MODULE,
    SUPPORTED_VLLM,
    check_vllm_version,
    kv_transfer_config,
)
from kvcanary.engines.vllm.connector import KvCanaryWorkerMeta, _rank_path, canary_options  # noqa: E402
from kvcanary.engines.vllm.forward_view import RequestRows, TokenWrites  # noqa: E402
from kvcanary.engines.vllm.layout import layer_kv_views, layer_number, probe_cpu_layout, token_rows  # noqa: E402
from kvcanary.engines.vllm.metrics import KvCanaryStats  # noqa: E402
from kvcanary.engines.vllm.plugin import register  # noqa: E402
from kvcanary.faults.vllm import KvCanaryFaultConnector, _token_element, faulted_kv_transfer_config  # noqa: E402


def test_version_pin_accepts_the_tested_version_and_refuses_others(monkeypatch):
    assert check_vllm_version().split("+")[0] == SUPPORTED_VLLM
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"^kv-canary: vLLM 0.33.0 is not supported"):
        check_vllm_version()


def _write_marked_block(kv: torch.Tensor, isa: str, block: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    nb, heads, bs, two_d = kv.shape
    key_cache, value_cache = kv.view(nb, heads, 2 * bs, two_d // 2).chunk(2, dim=2)
    slots = torch.arange(block * bs, block * bs + keys.shape[0], dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("isa,expected", [("amx", "amx"), ("vec", "vec"), ("vec16", "vec")])
def test_probe_finds_a_view_that_holds_exactly_each_tokens_kv(isa, expected):
    """The probed view of a real engine write returns, per slot, that token's K and V elements."""
    torch.manual_seed(0)
    nb, heads, bs, dim = 3, 2, 32, 64
    kv = torch.zeros(nb, heads, bs, 2 * dim, dtype=torch.bfloat16)
    try:
        layout = probe_cpu_layout(kv, isa)
    except RuntimeError as exc:  # an ISA this CPU lacks
        pytest.skip(f"isa {isa} unavailable: {exc}")
    if layout is None:
        pytest.skip(f"isa {isa} kernel not usable on this CPU")
    assert layout == expected
    keys = torch.randn(bs, heads, dim).to(torch.bfloat16)
    values = torch.randn(bs, heads, dim).to(torch.bfloat16)
    _write_marked_block(kv, isa, 1, keys, values)
    k_view, v_view = layer_kv_views(kv, layout)
    k_rows, v_rows = token_rows(k_view, bs), token_rows(v_view, bs)
    for t in (0, 1, 17, 31):
        slot = bs + t
        assert sorted(k_rows[slot].float().tolist()) == sorted(keys[t].flatten().float().tolist())
        assert sorted(v_rows[slot].float().tolist()) == sorted(values[t].flatten().float().tolist())
    assert not bool(k_rows[:bs].any()) and not bool(k_rows[2 * bs:].any())


def test_token_element_is_a_view_into_the_tokens_first_k_element():
    kv = torch.zeros(2, 2, 32, 128, dtype=torch.bfloat16)
    layout = probe_cpu_layout(kv, "vec")
    k_view, _ = layer_kv_views(kv, layout)
    el = _token_element(k_view, 1, 5, 32)
    el.view(torch.int16).bitwise_xor_(torch.tensor(1, dtype=torch.int16))
    changed = (kv.view(torch.int16) != 0).nonzero().tolist()
    assert len(changed) == 1
    rows = token_rows(k_view, 32)
    assert bool(rows[32 + 5].view(torch.int16).ne(0).any()) and int(rows.view(torch.int16).ne(0).sum()) == 1


def test_layer_number_from_vllm_layer_names():
    assert layer_number("model.layers.7.self_attn.attn", 0) == 7
    assert layer_number("attn", 3) == 3


def test_kv_transfer_config_one_connector_and_with_faults():
    one = kv_transfer_config(mode="raise", sweep_interval=4)
    assert one["kv_connector"] == CONNECTOR_NAME and one["kv_role"] == "kv_both"
    assert one["kv_connector_extra_config"] == {"kvcanary": {"mode": "raise", "sweep_interval": 4}}
    multi = faulted_kv_transfer_config([{"name": "redirect_block_table"}])
    assert multi["kv_connector"] == "MultiConnector"
    names = [c["kv_connector"] for c in multi["kv_connector_extra_config"]["connectors"]]
    assert names == ["KvCanaryFaultConnector", CONNECTOR_NAME]  # the injector acts first
    json.dumps(multi)  # usable as --kv-transfer-config


def test_kv_transfer_config_faults_is_deprecated_and_builds_the_faulted_config():
    faults = [{"name": "redirect_block_table", "after_forward": 3}]
    for options in ({}, {"mode": "raise", "on_violation": "abort"}):
        with pytest.warns(DeprecationWarning, match=r"faulted_kv_transfer_config"):
            old = kv_transfer_config(faults=faults, **options)
        assert old == faulted_kv_transfer_config(faults, **options)
    with pytest.warns(DeprecationWarning):
        assert kv_transfer_config(faults=[], mode="raise") == kv_transfer_config(mode="raise")  # no faults: canary alone


def test_old_fault_connector_path_imports_warns_and_exposes_the_new_objects(monkeypatch):
    """``kvcanary.engines.vllm.faults`` (moved to ``kvcanary.faults.vllm``) still imports, warns and hands out the
    same objects, so configs naming the old module path still load the connector."""
    import importlib
    import sys

    import kvcanary.faults.vllm as new

    monkeypatch.delitem(sys.modules, "kvcanary.engines.vllm.faults", raising=False)  # import it afresh
    with pytest.warns(DeprecationWarning, match=r"kvcanary\.engines\.vllm\.faults moved to kvcanary\.faults\.vllm"):
        old = importlib.import_module("kvcanary.engines.vllm.faults")
    assert old.__all__ == new.__all__
    for name in (*new.__all__, "_token_element", "_NoMetadata"):
        assert getattr(old, name) is getattr(new, name), name
    assert new.FAULT_CONNECTOR_MODULE == new.__name__ == FAULT_CONNECTOR_MODULE


def test_canary_options_extra_config_wins_over_env_and_rejects_bad_values(monkeypatch):
    from vllm.config import KVTransferConfig

    monkeypatch.setenv("KVCANARY_MODE", "raise")
    monkeypatch.setenv("KVCANARY_SWEEP_INTERVAL", "5")
    ktc = KVTransferConfig(**kv_transfer_config(mode="log", max_requests=64, real_kv_layers=[0]))
    config, adapter = canary_options(ktc)
    assert config.mode == "log" and config.sweep_interval == 5 and config.real_kv_layers == (0,)
    assert adapter == {"max_requests": 64}
    with pytest.raises(ValueError, match=r"^kv-canary: vLLM option max_context"):
        canary_options(KVTransferConfig(**kv_transfer_config(max_context=0)))
    with pytest.raises(ValueError, match=r"^kv-canary: mode"):
        canary_options(KVTransferConfig(**kv_transfer_config(mode="loud")))


def test_options_outside_the_kvcanary_key_are_refused_never_ignored():
    """An option placed directly in kv_connector_extra_config (not under "kvcanary") names itself and where
    it belongs; an unknown key is refused too; under "kvcanary" the same option is taken."""
    from vllm.config import KVTransferConfig

    entry = kv_transfer_config()
    for key, value in (("mode", "raise"), ("sweep_interval", 4), ("max_requests", 8)):
        misplaced = dict(entry, kv_connector_extra_config={key: value})
        with pytest.raises(TypeError, match=rf"^kv-canary: option '{key}' is directly in kv_connector_extra_config;"
                                            r".*\['kvcanary'\]"):
            canary_options(KVTransferConfig(**misplaced))
    with pytest.raises(TypeError, match=r"^kv-canary: unknown key 'sweep' in the canary connector"):
        canary_options(KVTransferConfig(**dict(entry, kv_connector_extra_config={"kvcanary": {}, "sweep": 1})))
    with pytest.raises(TypeError, match=r"^kv-canary: kv_connector_extra_config\['kvcanary'\] must be a dict"):
        canary_options(KVTransferConfig(**dict(entry, kv_connector_extra_config={"kvcanary": "mode=raise"})))
    config, _ = canary_options(KVTransferConfig(**kv_transfer_config(mode="raise", sweep_interval=4)))
    assert config.mode == "raise" and config.sweep_interval == 4


def test_stats_aggregate_across_ranks_and_reduce_for_the_log_line():
    a = KvCanaryStats(data={"forwards": 3, "violations": 1, "by_reason": {"verify_position": 1}})
    b = KvCanaryStats(data={"forwards": 3, "slots_verified": 10, "by_reason": {"verify_position": 2, "verify_token": 1}})
    merged = a.aggregate(b)
    assert merged.data == {"forwards": 6, "violations": 1, "slots_verified": 10,
                           "by_reason": {"verify_position": 3, "verify_token": 1}}
    reduced = merged.reduce()
    assert reduced["kv_canary_forwards"] == 6 and reduced["kv_canary_verify_position"] == 3
    assert KvCanaryStats(data={}).is_empty() and not merged.is_empty()


def test_worker_meta_merges_per_request_counts_and_reasons():
    a = KvCanaryWorkerMeta(per_request={"r1": [2, ["verify_position"]]})
    b = KvCanaryWorkerMeta(per_request={"r1": [1, ["verify_token"]], "r2": [1, ["verify_real_kv_hash"]]})
    m = a.aggregate(b)
    assert m.per_request == {"r1": [3, ["verify_position", "verify_token"]], "r2": [1, ["verify_real_kv_hash"]]}


def test_rank_paths_and_rows_and_history():
    assert _rank_path(None, 1, 2) is None
    assert _rank_path("/x/v.jsonl", 0, 1) == "/x/v.jsonl"
    assert _rank_path("/x/v.jsonl", 1, 2) == "/x/v.jsonl.rank1"
    assert _rank_path("/x/v{rank}.jsonl", 1, 2) == "/x/v1.jsonl"
    rows = RequestRows(2)
    assert rows.get("a") == 1 and rows.get("b") == 2 and rows.get("a") == 1
    with pytest.raises(RuntimeError, match=r"^kv-canary: more than max_requests=2"):
        rows.get("c")
    rows.hist[1] = rows.computed[1] = 7
    rows.release("a")
    assert rows.get("c") == 1
    assert rows.hist[1] == 0 and rows.computed[1] == 0  # a released row forgets its request
    writes = TokenWrites()
    a = lambda *x: np.asarray(x, dtype=np.int64)  # noqa: E731
    writes.add(a(3, 3, 3), a(0, 1, 2), a(5, 6, 7))
    writes.add(a(3), a(3), a(8))
    writes.add(a(3, 4), a(2, 0), a(9, 1))  # row 3 resent from position 2: the later value wins, each cell once
    assert [x.tolist() for x in writes.take(16)] == [[3, 3, 3, 3, 4], [0, 1, 3, 2, 0], [5, 6, 8, 9, 1]]
    assert [x.tolist() for x in writes.take(16)] == [[], [], []]
    writes.add(a(3, 5), a(0, 0), a(1, 2))
    writes.drop_rows([3])  # released: its pending cells go
    assert [x.tolist() for x in writes.take(16)] == [[5], [0], [2]]


def test_plugin_registers_connector_names_once():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME).__name__ == CONNECTOR_NAME
    assert KVConnectorFactory.get_connector_class_by_name("KvCanaryFaultConnector") is KvCanaryFaultConnector


def test_adapter_raises_typed_kvcanary_errors():
    """Every ``kv-canary:`` error of the adapter is a KvCanary* type (still a ValueError / RuntimeError)."""
    import pathlib
    import re

    import kvcanary

    root = pathlib.Path(kvcanary.__file__).parent
    pattern = re.compile(r'raise (ValueError|TypeError|RuntimeError|IndexError)\(\s*f?["\']kv-canary:')
    files = sorted((root / "engines" / "vllm").glob("*.py")) + sorted((root / "faults").glob("vllm*.py"))
    files += [root / "cli" / "demo_vllm.py"]
    assert [str(p) for p in files if pattern.search(p.read_text())] == []


def test_forward_counts_as_of_the_canary_step_the_device_counts_were_read_at():
    """`totals(wait=False)` pairs the device counts read back at the end of canary step s with the forward counts
    recorded when step s opened (the latest at or before s), so checked and engine forwards stay comparable."""
    from collections import deque

    from kvcanary.engines.vllm.connector import KvCanaryConnector

    class Worker:
        _forwards_at = KvCanaryConnector._forwards_at

    w = Worker()
    w._counted, w._counted_seen = deque(), (0, 0, 0, 0)
    assert w._forwards_at(0) == (0, 0, 0, 0)
    for step, fw in ((1, 1), (2, 3), (3, 4), (5, 7)):  # engine forwards run between canary steps (unchecked ones)
        w._counted.append((step, (fw, fw - 1, fw - 1, fw - step)))
    assert w._forwards_at(2) == (3, 2, 2, 1)
    assert w._forwards_at(2) == (3, 2, 2, 1) and len(w._counted) == 2  # popped once, remembered
    assert w._forwards_at(4) == (4, 3, 3, 1)
    assert w._forwards_at(9) == (7, 6, 6, 2) and not w._counted
