"""Chaos on transformers continuous batching (CPU, eager; the graph-mode driver without the capture): the
canary's internals and the adapter's own steps fail at seeded points, and ``generate_batch`` never notices.

Log mode: tokens identical to a canary-off run, every request served, torch's RNG as without the canary, no
violation reported, the failure said once and shown by the counters (``suspended``, ``checked_forwards <
engine_forwards`` when forwards ran after it, ``unchecked_forwards``), and ``generate_batch`` without the canary
still serves afterwards. Raise mode: one `KvCanaryError` from the ``with``, and the model serves after detach.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.cli.demo import generate, workload  # noqa: E402
from kvcanary.engines.transformers_cb import attach  # noqa: E402
from kvcanary.errors import KvCanaryError  # noqa: E402
from tests.chaos_support import RUNTIME_POINTS, ChaosError, ChaosPoint, ChaosRow, emit_table, inject, pick_cases  # noqa: E402
from tests.engines.cb_support import padded_like_graphs  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")

ADAPTER_POINTS = (
    ChaosPoint("describe", "kvcanary.engines.transformers_cb.forward_view:ForwardTranslator.describe", "adapter"),
    ChaosPoint("host_step", "kvcanary.engines.transformers_cb.forward_view:ForwardTranslator.host_step", "adapter"),
    ChaosPoint("live_slots", "kvcanary.engines.transformers_cb.forward_view:ForwardTranslator.live_slots", "sweep"),
    ChaosPoint("end_step", "kvcanary.runtime.canary:Canary.end_step", "adapter"),
)
OPTIONS = dict(sweep_interval=3, health_interval=0)
ROWS: list[ChaosRow] = []


def _prompts():
    return workload(seed=5, num_requests=6)


@pytest.fixture(scope="module")
def reference(llama):
    torch.manual_seed(77)
    tokens = generate(llama, _prompts())
    rng = torch.get_rng_state()
    with attach(llama, mode="log", **OPTIONS) as handle:
        clean = generate(llama, _prompts())
    c = handle.counters()
    assert clean == tokens and c["total"] == 0 and c["engine_forwards"] == c["checked_forwards"] > 0
    return tokens, rng, c["engine_forwards"]


def _cases():
    points = [p for p in RUNTIME_POINTS if p.name not in ("flush",)] + list(ADAPTER_POINTS)
    return pick_cases(424242, points, 9, max_call=10, max_calls={"sweep": 4, "sweep_live": 3, "live_slots": 3})


def _run_case(llama, monkeypatch, point, at_call, when, *, graph_driver: bool, reference, caplog):
    tokens, rng, clean_forwards = reference
    if graph_driver:
        padded_like_graphs(monkeypatch)  # the compute_batch wrapper drives the steps, as with CUDA graphs
    inj = inject(monkeypatch, point, at_call=at_call, when=when)
    torch.manual_seed(77)
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        with attach(llama, mode="log", graph_driver=graph_driver, **OPTIONS) as handle:
            out = generate(llama, _prompts())
    assert out == tokens  # identical tokens, no request lost
    assert torch.equal(torch.get_rng_state(), rng)
    c = handle.counters()
    assert handle.errors == [] and c["total"] == 0
    if not graph_driver:
        assert c["engine_forwards"] == clean_forwards
    if inj.fired:
        assert c["canary_errors"] >= 1 and c["unchecked_forwards"] >= 1
        assert c["checked_forwards"] < c["engine_forwards"]
        said = [r for r in caplog.records if r.levelno >= logging.ERROR and "ChaosError" in r.getMessage()]
        assert len(said) >= 1
    else:
        assert c["checked_forwards"] == c["engine_forwards"]
    monkeypatch.undo()  # the chaos and the graph driver gone: the same model serves without the canary
    assert generate(llama, _prompts()) == tokens
    ROWS.append(ChaosRow(engine="transformers" + ("/graph-driver" if graph_driver else ""), mode="log",
                         case=inj.label, fired=inj.fired, same_outputs=out == tokens,
                         engine_forwards=c["engine_forwards"], checked_forwards=c["checked_forwards"],
                         unchecked_forwards=c["unchecked_forwards"], suspended=c["canary_errors"] > 0,
                         serves_after=True, notes=point.stage))


@pytest.mark.parametrize("point,at_call,when", _cases(), ids=lambda v: getattr(v, "name", str(v)))
def test_log_mode_eager(llama, monkeypatch, point, at_call, when, reference, caplog):
    _run_case(llama, monkeypatch, point, at_call, when, graph_driver=False, reference=reference, caplog=caplog)


@pytest.mark.parametrize("point,at_call,when", pick_cases(99, [p for p in RUNTIME_POINTS if p.stage == "forward"]
                                                           + list(ADAPTER_POINTS[:2]) + [ADAPTER_POINTS[3]], 3,
                                                           max_call=6),
                         ids=lambda v: getattr(v, "name", str(v)))
def test_log_mode_graph_driver(llama, monkeypatch, point, at_call, when, reference, caplog):
    tokens, _, _ = reference
    padded_ref = None
    with monkeypatch.context() as m:  # the padded engine's own tokens (padding may change nothing, checked here)
        padded_like_graphs(m)
        padded_ref = generate(llama, _prompts())
    assert padded_ref == tokens
    _run_case(llama, monkeypatch, point, at_call, when, graph_driver=True, reference=reference, caplog=caplog)


@pytest.mark.parametrize("point,at_call", [(RUNTIME_POINTS[2], 4), (ADAPTER_POINTS[0], 3)], ids=["head", "describe"])
def test_raise_mode_is_one_kvcanary_error_and_the_model_serves_after_detach(llama, monkeypatch, point, at_call,
                                                                             reference):
    tokens, _, _ = reference
    inj = inject(monkeypatch, point, at_call=at_call)
    with pytest.raises(KvCanaryError) as err:
        with attach(llama, mode="raise", **OPTIONS):
            generate(llama, _prompts())
    assert inj.fired and str(err.value).startswith("kv-canary:")
    assert isinstance(err.value.__cause__, ChaosError) or "ChaosError" in str(err.value)
    monkeypatch.undo()
    assert generate(llama, _prompts()) == tokens
    ROWS.append(ChaosRow(engine="transformers", mode="raise", case=inj.label, fired=True, same_outputs=None,
                         engine_forwards=0, checked_forwards=0, unchecked_forwards=0, suspended=True,
                         serves_after=True, notes="KvCanaryError"))


def test_eager_fallback_refuses_engine_graphs_and_serves_unchecked(llama, monkeypatch, reference, caplog,
                                                                  eager_fallback):
    """On the eager fallback (a CUDA machine without a working Triton, opted in) an engine with CUDA graphs is refused
    when its session opens: log mode serves every request unchanged, unchecked and counted; raise mode raises it."""
    tokens, _, _ = reference
    padded_like_graphs(monkeypatch)  # graph mode without the capture
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        with attach(llama, mode="log", graph_driver=True, **{**OPTIONS, "stats_interval": 4}) as handle:
            out = generate(llama, _prompts())
    assert out == tokens
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kv_canary stats:")]
    assert lines and "checked_forwards=0" in lines[-1] and "state=suspended: internal" in lines[-1]
    c = handle.counters()
    assert "needs CUDA graphs" in c["last_suspension"] and "eager fallback" in c["last_suspension"]
    assert c["checked_forwards"] == 0 < c["engine_forwards"] == c["unchecked_forwards"] and c["canary_errors"] == 1
    with pytest.raises(KvCanaryError, match=r"^kv-canary: continuous batching with the engine's CUDA graphs"):
        with attach(llama, mode="raise", graph_driver=True, **OPTIONS):
            generate(llama, _prompts())
    ROWS.append(ChaosRow(engine="transformers/graph-driver", mode="log", case="eager fallback + engine graphs",
                         fired=True, same_outputs=out == tokens, engine_forwards=c["engine_forwards"],
                         checked_forwards=c["checked_forwards"], unchecked_forwards=c["unchecked_forwards"],
                         suspended=True, serves_after=True, notes="refused"))


def test_zz_print_the_chaos_table():
    if ROWS:
        emit_table("chaos: transformers continuous batching (CPU)", ROWS)
