"""kvcanary on the real transformers continuous-batching engine (CPU, tiny random models).

Models and workload come from the demo (`kvcanary.cli.demo`): a 2-layer Llama with prefix sharing
and a 4-layer Qwen3 with sliding-window layers (window 16, pages of 16, 64 tokens per step), so
prompts are chunked, prefixes are reused, blocks are freed and reallocated and the window wraps.
A probe hook (reading only the forward's kwargs) counts what the canary should have verified.
"""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402
from transformers.generation.continuous_batching import continuous_api, input_outputs, model_runner  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FullAttentionCacheAllocator,
    SlidingAttentionCacheAllocator,
)

import kvcanary  # noqa: E402
from kvcanary.cli.demo import SLIDING_WINDOW, FlipSharedBlockByte, RedirectRead, generate, workload  # noqa: E402
from engines.cb_support import BetweenSteps, padded_like_graphs  # noqa: E402
from kvcanary.engines.transformers_cb import attach, compat  # noqa: E402
from kvcanary.engines.transformers_cb.attach import _refuse_unobservable_paths  # noqa: E402
from kvcanary.engines.transformers_cb.forward_view import ForwardTranslator  # noqa: E402
from kvcanary.runtime import CanaryViolationError  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_engine")


class Probe:
    """Independent bookkeeping from the forward kwargs and the batch: per forward, each row's first
    position P and query length E; which requests wrote each full-attention block."""

    def __init__(self, model) -> None:
        self.rows: list[list[tuple[str, int, int]]] = []
        self.block_writers: dict[int, set[str]] = {}
        self._owner = None
        self._hook = model.register_forward_pre_hook(self._pre, with_kwargs=True)

    def _pre(self, module, args, kwargs):
        from kvcanary.engines.transformers_cb.forward_view import find_batch_processor

        cache = kwargs["cache"]
        if self._owner is None or self._owner[0] is not cache:
            self._owner = (cache, find_batch_processor(cache))
        batch = self._owner[1].inputs_and_outputs.requests_in_batch
        cu = kwargs["cu_seq_lens_q"].tolist()
        pos = kwargs["position_ids"][0].tolist()
        self.rows.append([(fs.state.request_id, pos[cu[i]], cu[i + 1] - cu[i]) for i, fs in enumerate(batch)])
        full = cache.cache_allocators.get("full_attention")
        if full is not None:
            w = kwargs["write_index"][full.index]
            for i, fs in enumerate(batch):
                for phys in w[cu[i] : cu[i + 1]].tolist():
                    self.block_writers.setdefault(phys // full.block_physical_stride, set()).add(fs.state.request_id)

    def remove(self) -> None:
        self._hook.remove()

    def expected_head_verifies(self, window: int) -> int:
        """Plan entries per docs/design.md §3.5: P per row (full), min(P, W) per row (sliding window)."""
        full = sum(p for fwd in self.rows for _, p, _ in fwd)
        swa = sum(min(p, window) for fwd in self.rows for _, p, _ in fwd) if window else 0
        return full + swa


# ---- an independent per-row reference of the translation ------------------------------------------
def check_against_per_row_reference(translator, kwargs, batch) -> int:
    """Compare what `describe` just produced with a plain per-row reading of the same kwargs (the
    pre-vectorisation translation): the table entries the plan reads (and the write's seed) and the token
    history of every batch row. Returns the number of rows checked."""
    cu_q = kwargs["cu_seq_lens_q"].tolist()
    ids = kwargs["input_ids"][0].tolist()
    for g in translator.layouts:
        table = translator.req_to_token[g.name]
        read = kwargs["read_index"][g.index]
        cu_k = kwargs["cu_seq_lens_k"][g.layer_type].tolist()
        win = g.sliding_window
        for i, fs in enumerate(batch):
            e = fs.query_length
            p = fs.state.position_offset - e
            row = translator.rows.row_of[fs.state.request_id]
            if win:  # the plan's window [P - W, P): P - W (no query reads it) is padding, then every read
                cached = min(p, win - 1)
                expected = [0] * (p - cached - max(0, p - win))
                if read.numel() and cached:
                    seg = read[cu_k[i] : cu_k[i] + cached]
                    expected += g.physical_to_slot(seg, for_write=False).tolist()
                got = table[row, max(0, p - win) : p].tolist()
            else:
                expected = g.physical_to_slot(read[cu_k[i] : cu_k[i] + p], for_write=False).tolist() if p else []
                got = table[row, :p].tolist()
            assert got == expected, f"{g.name} table of {fs.state.request_id} (P={p}, E={e})"
            if p:  # the write's seed slot
                assert table[row, p - 1].item() == (expected[-1] if expected else 0)
            history = (list(fs.state.initial_tokens) + list(fs.state.generated_tokens))[:p] + ids[cu_q[i] : cu_q[i + 1]]
            assert translator.token_table[row, : p + e].tolist() == history
    return len(batch)


# ---- clean runs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,static", [("llama", False), ("qwen3", False), ("llama", True), ("qwen3", True)])
def test_clean_workload_identical_tokens_zero_violations_every_slot_counted(kind, static, llama, qwen3, monkeypatch):
    """``static``: the eager forwards are translated from fixed-shape copies of their kwargs (what the
    translation graph replays on CUDA), here without the graph."""
    model = llama if kind == "llama" else qwen3
    prompts = workload(seed=1)
    reference = generate(model, prompts)
    batches, checked_rows = [], []
    describe = ForwardTranslator.describe

    def describe_and_check(self, kwargs):
        out = describe(self, kwargs)
        batch = list(compat.requests_in_batch(self.processor))
        checked_rows.append(check_against_per_row_reference(self, kwargs, batch))
        n = int(kwargs["cu_seq_lens_q"][-1])  # the forward's tokens (fixed-shape copies: padding past them)
        for g in self.layouts:
            w = kwargs["write_index"][g.index][:n]
            loc = out.groups[g.name].out_cache_loc.tolist()
            assert loc[:n] == g.physical_to_slot(w, for_write=True).tolist() and set(loc[n:]) <= {-1}
        batches.append(out)
        return out

    monkeypatch.setattr(ForwardTranslator, "describe", describe_and_check)
    probe = Probe(model)
    reports: list = []
    try:
        with attach(model, mode="raise", sweep_interval=4, static_translation=static) as handle:
            checked = generate(model, prompts)
            assert (handle._current.statics is not None) == static
            reports.append(handle.sweep())  # after the run: only the prefix cache's idle blocks are live
    finally:
        probe.remove()

    assert checked == reference, "the canary changed the generated tokens"
    assert len(checked) == len(prompts)
    assert handle.violations() == [] and handle.counters().get("total", 0) == 0 and handle.errors == []
    (stats,) = handle.stats()
    assert stats.forwards == len(probe.rows) == handle.forwards == len(checked_rows)
    assert sum(checked_rows) == sum(len(fwd) for fwd in probe.rows)
    window = SLIDING_WINDOW if kind == "qwen3" else 0
    expected = probe.expected_head_verifies(window)
    assert stats.slots_verified["head"] == expected
    assert stats.slots_verified["tail"] == 2 * expected  # K and V sides
    assert stats.sweep_passes > 0 and sum(p["verified"] for p in stats.last_pass.values()) > 0
    counters = handle.counters()
    assert counters["checked_forwards"] == counters["engine_forwards"] == stats.forwards
    for batch in batches:  # the canary never writes one slot twice in a launch (sliding-window trash is skipped)
        for group in batch.groups.values():
            stored = group.out_cache_loc[group.out_cache_loc >= 0]
            assert stored.unique().numel() == stored.numel()
    for report in reports:
        assert sum(report.unrecorded.values()) == 0 and report.complete
    # the workload really exercised what the canary must survive
    first_seen: dict[str, int] = {}
    for fwd in probe.rows:
        for rid, p, _ in fwd:
            first_seen.setdefault(rid, p)
    assert any(p > 0 and e > 1 for fwd in probe.rows for _, p, e in fwd), "no chunked prefill"
    if kind == "llama":
        assert any(p > 0 for p in first_seen.values()), "no prefix-cache hit"
        assert any(len(w) > 1 for w in probe.block_writers.values()), "no block freed and reused"
    else:
        assert max(p + e for fwd in probe.rows for _, p, e in fwd) > 2 * SLIDING_WINDOW, "window never wrapped"
        assert any(p > 0 and e >= SLIDING_WINDOW for fwd in probe.rows for _, p, e in fwd), "no chunk >= window"


def test_rotating_sweep_with_a_shared_sector_pool(qwen3):
    """transformers hands a sector freed by one allocator to the other during a sweep pass: the adapter releases
    the freed blocks from the pass (``Canary.release_slots``), so the sweep never checks the rewritten slots (no
    stale row left for the drain to discard) and nothing is reported."""
    with attach(qwen3, mode="log", sweep_interval=4) as handle:
        generate(qwen3, workload(seed=1))
    assert handle.violations() == []
    assert handle.counters()["moves"]["slots_released"] > 0
    assert sum(s.sweep_stale for s in handle.stats()) == 0


def test_graph_driver_on_eager_forwards(llama):
    """The graph-mode driver (the compute_batch wrapper: host half around the engine call, hooks doing
    device work only) on an engine that runs eagerly: every forward checked, same tokens, wrapper removed."""
    prompts = workload(seed=1, num_requests=6)
    reference = generate(llama, prompts)
    with attach(llama, mode="raise", sweep_interval=4, graph_driver=True) as handle:
        checked = generate(llama, prompts)
        runner = handle._current.processor.model_runner
        assert "compute_batch" in vars(runner)
    assert checked == reference
    assert handle.violations() == [] and handle.errors == []
    counters = handle.counters()
    assert counters["engine_forwards"] == counters["checked_forwards"] == handle.forwards > 0
    # one session, never suspended: the wrapper was installed once; detach restored the class method
    assert handle.sessions == 1 and counters["last_suspension"] is None and "compute_batch" not in vars(runner)


def test_decode_fast_path_translation_matches_the_indexed_one(llama, monkeypatch):
    """The decode fast path (block table, flash_attn_with_kvcache; CUDA only) translated from a block table
    built from the allocator gives the same position -> slot rows and written slots as the index path."""
    compared = []
    describe = ForwardTranslator.describe

    def both(self, kwargs):
        out = describe(self, kwargs)
        batch = list(compat.requests_in_batch(self.processor))
        if not all(fs.query_length == 1 for fs in batch):
            return out
        (g,) = self.layouts
        blocks_of = compat.request_blocks(compat.allocators(self.cache)[g.layer_type])
        blocks = [blocks_of[fs.state.request_id] for fs in batch]
        pages = torch.full((1, len(batch) + 1, max(map(len, blocks)) + 2), -1, dtype=torch.int32)  # + a padding row
        for i, b in enumerate(blocks):
            pages[0, i, : len(b)] = torch.tensor(b, dtype=torch.int32) * g.pages_stride
        paged = dict(kwargs, block_table=pages[:, : len(batch)])
        indexed_table = self.req_to_token[g.name]
        self.req_to_token[g.name] = torch.zeros_like(indexed_table)
        try:
            out_paged = describe(self, paged)
            for fs in batch:
                row, p = self.rows.row_of[fs.state.request_id], fs.state.position_offset - 1
                assert self.req_to_token[g.name][row, : p + 1].tolist() == indexed_table[row, : p + 1].tolist()
        finally:
            self.req_to_token[g.name] = indexed_table
        assert out_paged.groups[g.name].out_cache_loc.tolist() == out.groups[g.name].out_cache_loc.tolist()
        compared.append(len(batch))
        return out

    monkeypatch.setattr(ForwardTranslator, "describe", both)
    with attach(llama, mode="raise", sweep_interval=0):
        generate(llama, workload(seed=1))
    assert len(compared) > 3 and max(compared) > 1


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_padded_batches_and_warmup_as_in_graph_mode(kind, llama, qwen3, monkeypatch):
    """Graph mode without the capture: padded static batches (padding sequences and tokens, padded read
    indices), the runner's warmup forwards, steps driven by the compute_batch wrapper. Every engine
    forward is checked (warmup forwards too: padding rows only), tokens are unchanged."""
    model = llama if kind == "llama" else qwen3
    padded_like_graphs(monkeypatch)
    prompts = workload(seed=1, num_requests=8)
    reference = generate(model, prompts)  # padded too
    batches = []
    describe = ForwardTranslator.describe

    def keep(self, kwargs):
        out = describe(self, kwargs)
        batches.append((out.batch_size, out.num_tokens, len(compat.requests_in_batch(self.processor))))
        return out

    monkeypatch.setattr(ForwardTranslator, "describe", keep)
    with attach(model, mode="raise", sweep_interval=4, graph_driver=True) as handle:
        checked = generate(model, prompts)
    assert checked == reference
    assert handle.violations() == [] and handle.errors == []
    counters = handle.counters()
    assert counters["engine_forwards"] == counters["checked_forwards"] == handle.forwards > 0
    assert counters["warmup_forwards"] > 0
    assert any(rows > real for rows, _, real in batches), "no padding sequence"
    assert {tokens for _, tokens, _ in batches} == {64}, "the padded batches have max_batch_tokens tokens"


def test_tables_are_staged_before_the_runtime_freezes_them(llama, monkeypatch):
    """Under CUDA graphs the runtime freezes its static inputs at the first stage it sees inside a capture
    and from then on insists on the same table objects. The warmup's eager forward stages the adapter's
    tables first; here every stage after a session's first finds the buffers frozen, as a capture leaves them
    (frozen identity checks)."""
    from kvcanary.runtime import Canary

    padded_like_graphs(monkeypatch)
    stages = {"n": 0}
    stage = Canary.stage

    def counted(self, batch):
        if stages["n"] > 0:
            self.static.frozen = True  # what a stage inside an engine's capture sets (`Canary.stage`)
        stage(self, batch)
        stages["n"] += 1

    monkeypatch.setattr(Canary, "stage", counted)
    with attach(llama, mode="raise", sweep_interval=4, graph_driver=True) as handle:
        generate(llama, workload(seed=1, num_requests=6))
    assert handle.errors == [] and handle.violations() == [] and stages["n"] > 2
    counters = handle.counters()
    assert counters["warmup_forwards"] > 0 and counters["engine_forwards"] == counters["checked_forwards"] > 0


def test_redirected_read_between_steps_with_padded_batches(llama, monkeypatch):
    """The fault lands in the engine's static read index after batch preparation (where a graph replay
    would read it), and is charged to the reading request at its step."""
    padded_like_graphs(monkeypatch)
    injector = RedirectRead(group="full", seed=4, after_step=2)
    handle = attach(llama, mode="log", sweep_interval=0, graph_driver=True)
    BetweenSteps(injector, handle, replays_only=False).install(monkeypatch)
    with handle:
        generate(llama, workload(seed=1))
    (inj,) = injector.ledger
    at_step = [v for v in handle.violations() if v.step == inj.step]
    assert at_step and all(v.request_id == inj.request_id for v in at_step)
    assert any(v.slot == inj.slot and "verify_position" in v.reason_label for v in at_step)


# ---- faults ----------------------------------------------------------------------------------------
def _sequential_prefix_workload() -> list[list[int]]:
    """One request at a time, all sharing a 40-token system prompt: every later request reuses the
    cached blocks of the earlier ones, alone in its forward (unambiguous attribution)."""
    prompts = workload(seed=2, num_requests=6)
    return [p for p in prompts if len(p) > 40][:4]


def _run_with(model, injector, *, mode, prompts, **gen_kw):
    injector.install(model)
    try:
        with attach(model, mode=mode, sweep_interval=0) as handle:
            generate(model, prompts, **gen_kw)
    finally:
        injector.remove()
    return handle


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_flipped_byte_in_cached_shared_block_is_charged_to_the_reusing_request(mode, llama):
    injector = FlipSharedBlockByte(seed=3, after_step=0)
    prompts = _sequential_prefix_workload()
    if mode == "log":
        handle = _run_with(llama, injector, mode=mode, prompts=prompts, max_requests_per_batch=1)
        found = handle.violations()
    else:
        with pytest.raises(CanaryViolationError) as info:
            _run_with(llama, injector, mode=mode, prompts=prompts, max_requests_per_batch=1)
        found = info.value.violations
    (inj,) = injector.ledger
    hits = [v for v in found if v.slot == inj.slot and v.group == "full"]
    assert hits, f"flip at slot {inj.slot} not reported: {[v.log_line() for v in found]}"
    first = min(hits, key=lambda v: v.step)
    assert first.reason_label == "verify_real_kv_hash"
    assert first.request_id == inj.request_id and first.step == inj.step
    assert first.launch_tag.name == "TAIL_K_FULL"


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_read_redirected_to_another_live_slot_is_charged_to_the_reading_request(mode, llama):
    injector = RedirectRead(group="full", seed=4, after_step=2)
    prompts = workload(seed=1)
    if mode == "log":
        handle = _run_with(llama, injector, mode=mode, prompts=prompts)
        found = handle.violations()
    else:
        with pytest.raises(CanaryViolationError) as info:
            _run_with(llama, injector, mode=mode, prompts=prompts)
        found = info.value.violations
    (inj,) = injector.ledger
    at_step = [v for v in found if v.step == inj.step]
    assert at_step, "redirect not reported in the forward that read the wrong slot"
    assert all(v.request_id == inj.request_id for v in at_step)
    labels = {label for v in at_step for label in v.reason_label.split("+")}
    assert "verify_position" in labels and "verify_chain_hash" in labels
    wrong = [v for v in at_step if v.slot == inj.slot]
    assert wrong and all(v.stored_position != v.expected_position for v in wrong)
    if mode == "log":  # one-shot fault: the engine's next read indices are right again
        assert all(v.step == inj.step for v in found if "verify_position" in v.reason_label)


def test_redirected_read_in_the_sliding_window_group(qwen3):
    injector = RedirectRead(group="swa", seed=5, after_step=2)
    handle = _run_with(qwen3, injector, mode="log", prompts=workload(seed=1))
    (inj,) = injector.ledger
    at_step = [v for v in handle.violations() if v.step == inj.step]
    assert at_step and {v.group for v in at_step} == {"swa"}
    assert all(v.request_id == inj.request_id for v in at_step)
    assert any("verify_position" in v.reason_label for v in at_step if v.slot == inj.slot)


# ---- attach / detach ---------------------------------------------------------------------------------
_ENGINE_CLASSES = [
    cb_cache.PagedAttentionCache, continuous_api.ContinuousBatchProcessor, continuous_api.ContinuousBatchingManager,
    continuous_api.ContinuousMixin, model_runner.ModelRunner, input_outputs.ContinuousBatchingIOs,
    FullAttentionCacheAllocator, SlidingAttentionCacheAllocator, torch.nn.Module,
]
_HOOK_DICTS = ["_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called"]


def _snapshot(model) -> dict:
    return {
        "classes": {c.__qualname__: {k: id(v) for k, v in vars(c).items()} for c in _ENGINE_CLASSES + [type(model)]},
        "model_attrs": {k: id(v) for k, v in vars(model).items() if k not in _HOOK_DICTS},
        "hooks": {name: dict(getattr(model, name)) for name in _HOOK_DICTS},
        "module_hooks": {n: [dict(getattr(m, h)) for h in _HOOK_DICTS] for n, m in model.named_modules()},
    }


def test_detach_leaves_model_and_engine_classes_exactly_as_they_were(llama):
    before = _snapshot(llama)
    handle = kvcanary.attach(llama, mode="log")
    assert _snapshot(llama)["hooks"] != before["hooks"]  # attach did hook the model
    generate(llama, workload(seed=1, num_requests=3))
    forwards = handle.forwards
    assert forwards > 0
    handle.detach()
    assert _snapshot(llama) == before
    generate(llama, workload(seed=1, num_requests=3))
    assert handle.forwards == forwards  # nothing runs once detached
    handle.detach()  # idempotent


def test_mode_none_attaches_nothing(llama):
    before = _snapshot(llama)
    with attach(llama, mode="none") as handle:
        assert _snapshot(llama) == before
    assert handle.sessions == 0 and handle.forwards == 0


def test_other_transformers_versions_are_refused(llama, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.23.1")
    with pytest.raises(RuntimeError, match=r"^kv-canary: transformers 5\.23\.1 is not supported; .*==5\.24\.0"):
        attach(llama)


def test_compile_and_async_batching_are_refused_graphs_are_not():
    def processor(graphs=(False, False), compiled=None, use_async=False):
        runner = types.SimpleNamespace(use_cuda_graph_varlen=graphs[0], use_cuda_graph_decode=graphs[1],
                                       _compiled_varlen=compiled, _compiled_decode=None)
        return types.SimpleNamespace(model_runner=runner, use_async_batching=use_async)

    _refuse_unobservable_paths(processor())
    _refuse_unobservable_paths(processor(graphs=(True, True)))  # checked: the hooks run during capture
    with pytest.raises(RuntimeError, match=r"^kv-canary: torch.compile is on"):
        _refuse_unobservable_paths(processor(compiled=object()))
    with pytest.raises(RuntimeError, match=r"^kv-canary: async batching is on.*use_async_batching=False"):
        _refuse_unobservable_paths(processor(use_async=True))


def test_requests_beyond_max_context_fail_loudly(llama):
    with pytest.raises(RuntimeError, match=r"^kv-canary: request req_\d+ reaches position \d+, beyond max_context=24"):
        with attach(llama, mode="raise", max_context=24):  # log mode: runs unchecked (test_transformers_attach)
            generate(llama, workload(seed=1, num_requests=2))


def test_kvcanary_attach_stays_callable_after_adapter_imports():
    """`kvcanary.attach` must stay the function even once every kvcanary module is imported."""
    import kvcanary
    import kvcanary.cli.demo  # noqa: F401  (imports the adapter and the dispatcher)
    import kvcanary.engines.dispatch  # noqa: F401

    assert callable(kvcanary.attach)
    assert kvcanary.attach is kvcanary.engines.dispatch.attach
