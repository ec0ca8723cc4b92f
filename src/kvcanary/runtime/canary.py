"""`Canary`: the object an engine adapter holds — one per engine instance.

How an adapter drives it (the whole engine-facing API):

1. Create it once, after the KV pools exist::

       canary = create_canary(CanaryConfig.from_env(), groups=[GroupSpec(name="full", num_slots=N,
                              layer_ids=(0, 1, 2, 3))], max_requests=R, max_context=C, device=dev)
       # None in mode "none": attach nothing, pay nothing.

2. Tell it where each group's real K/V live (per layer; the config picks which layers are hashed)::

       canary.set_kv_cache("full", {layer: (k_tensor, v_tensor) for layer in ...}, page_size=P)

   ``k_tensor`` / ``v_tensor`` hold slot ``s`` at row ``s // P``, byte column ``(s % P) * bytes_per_token``
   (e.g. ``[num_slots, heads, dim]`` with P = 1, or ``[num_pages, P, heads, dim]``). Tensors must stay
   the same objects (the engine's preallocated pools); call again if the engine reallocates them.

3. Tell it which slots are live (allocated: running requests and idle prefix-cache entries), for the
   periodic sweep — a callable returning ``{group name: int tensor of slot indices}``::

       canary.set_live_slots_provider(lambda: {"full": allocator.used_slots()})

   and, as slots are freed between forwards, ``canary.release_slots("full", freed)``: a pass takes its live
   set once, at its start, and must not go on checking a slot the engine freed (and may have reused) since.

4. Around every model forward::

       with canary.forward(batch):          # batch: BatchDescription, built before the forward
           engine.run_model(...)            # writes the KV of batch.groups[g].out_cache_loc

   or the two halves ``before_forward(batch)`` / ``after_forward()`` when a ``with`` does not fit
   (hooks). A forward entered while another is open passes through unchecked (re-entrancy).
   ``BatchDescription`` carries request rows, prefix / extend lengths, input ids and positions, the
   position -> slot table per group (or a full table + LUT for a sliding-window group), the slots
   written, request ids (for attribution) and, optionally, token histories (verify-token check)
   and a token oracle (write-input assert).

   The hot path does no host synchronisation and O(1) Python per forward: the batch is copied into
   static device buffers, every launch reads only those, and violations are drained a step or more
   later (non-blocking copies; ``raise`` mode waits at the end of each step). Each half splits in two,
   so an engine that captures its forward in a CUDA graph can capture the canary's device work with it:

       step = canary.begin_step(request_ids=ids, forward_kind="decode")   # host, per forward / replay
       canary.stage(batch); canary.launch_head()     # device: capturable (pre-forward)
       ... forward ...
       canary.launch_tail()                          # device: capturable (post-forward)
       canary.end_step()                             # host, per forward / replay

   ``before_forward(batch)`` is ``begin_step + stage + launch_head``; ``after_forward()`` is
   ``launch_tail + end_step``. With no engine graph, `capture_graphs` captures the canary's own device
   work once and replays it per forward. With the engine's graphs holding HEAD / TAIL, `capture_sweep_graph`
   captures the rotating sweep slice that `end_step` runs, so a replayed step launches nothing from Python.

5. Optionally call ``note_engine_forward()`` from the engine's own step loop (not from the hook):
   the health watchdog then notices forwards that ran without the canary, and ``engine_forwards`` counts
   them whatever the canary does.

Fail-safe: on CUDA the device path is proved when the canary is created (`device_probe.prove_device_path`:
refused, or the eager fallback when the config opts in). In ``log`` mode an exception of the canary itself —
in a bracket, a sweep, a move or a drain — never reaches the engine: it is logged once, counted
(``canary_errors``) and *suspends* the canary (``suspended`` names the cause): every later forward passes
through unchecked and is counted (``unchecked_forwards``), so ``checked_forwards < engine_forwards`` shows it.
Suspending rather than skipping one forward matters: a forward that ran without the canary wrote KV with no
records, and checking those slots later would report violations that are not there. In ``raise`` mode the
failure is raised once as a `KvCanaryError` (its cause chained) and the canary is suspended as well.

Users read results with `violations`, `counters`, `stats`, `memory_bytes`; `close` sweeps every live slot
once more (when the sweep is on), drains the last step and returns final stats.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from kvcanary.errors import KvCanaryError, KvCanaryRuntimeError, KvCanaryValueError
from kvcanary.ops import dispatch
from kvcanary.runtime.attribution import Attributor, StepEntry, StepLog, Violation
from kvcanary.runtime.batch import BatchDescription, GroupSpec
from kvcanary.runtime.config import CanaryConfig
from kvcanary.runtime.counters import LaunchCounters
from kvcanary.runtime.cuda_host import capturing
from kvcanary.runtime.device_probe import DevicePath, prove_device_path
from kvcanary.runtime.drain import Harvest, ViolationDrain, ViolationRings
from kvcanary.runtime.fail_together import FailTogether
from kvcanary.runtime.graphs import CanaryGraphs, GraphSet, capture_sweep_slice, run_empty_buckets
from kvcanary.runtime.groups import CanaryGroup
from kvcanary.runtime.health import CanaryHealthError, HealthWatchdog
from kvcanary.runtime.launch import ForwardLaunches
from kvcanary.runtime.lookup import RecordLookup
from kvcanary.runtime.moves import MoveReport, SlotMoves, move_tags
from kvcanary.runtime.owners import OWNER_SPAN
from kvcanary.runtime.polled import PolledWords
from kvcanary.runtime.reads import append_read_rows
from kvcanary.runtime.report import CanaryViolationError, ViolationLedger
from kvcanary.runtime.staging import StaticBatch
from kvcanary.runtime.stats import CanaryStats, StatsReporter
from kvcanary.runtime.sweep import SweepReport, Sweeper

LiveSlotsProvider = Callable[[], Mapping[str, torch.Tensor]]
KvLayers = Union[Mapping[int, tuple[torch.Tensor, torch.Tensor]], Callable[[int], tuple[torch.Tensor, torch.Tensor]]]

logger = logging.getLogger("kvcanary")

DEFAULT_MAX_BATCH_TOKENS = 8192


def create_canary(config: CanaryConfig, **kwargs: object) -> Optional["Canary"]:
    """A `Canary` for ``config``, or None when ``config.mode == "none"`` (nothing attached).

    ``kwargs`` are `Canary`'s: groups, max_requests, max_context, max_batch_tokens, device.
    """
    if not config.enabled:
        return None
    return Canary(config, **kwargs)  # type: ignore[arg-type]


class Canary:
    """Shadow records for every KV slot of an engine, checked around each forward.

    Args:
        config: what to check and how to report (mode must not be ``none``: use `create_canary`).
        groups: one `GroupSpec` per attention group (``full``, and ``swa`` for sliding window; further groups of
            a kind as ``full.1``, ``swa.1``, ...: each its own slot space, records and rings, named in violations).
        max_requests: rows of the engine's request table (row 0 = padding) — sizes the batch rows.
        max_context: longest sequence the engine serves — sizes the verify plan.
        max_batch_tokens: tokens one forward computes at most — sizes the static token buffers.
        device: where the engine's KV and tables live; the canary's buffers go there too.

    Device memory (reported when it attaches, and by `memory_bytes`): per group and slot, a HEAD
    record and one TAIL record per hashed side (32 bytes each) plus 40 bytes of write-time slot
    records for the sweep; plus the static batch buffers, plans and violation rings.
    """

    def __init__(
        self,
        config: CanaryConfig,
        *,
        groups: Sequence[GroupSpec],
        max_requests: int,
        max_context: int,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        device: Union[str, torch.device] = "cpu",
    ) -> None:
        _check_arguments(config, groups, max_requests=max_requests, max_context=max_context,
                         max_batch_tokens=max_batch_tokens)
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:N": tensors compare by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        # before any buffer exists: refuse (or fall back) while nothing has been allocated
        self.device_path: DevicePath = prove_device_path(self.device, allow_eager_fallback=config.allow_eager_fallback)
        self._build_device_parts(groups, max_requests=max_requests, max_context=max_context,
                                 max_batch_tokens=max_batch_tokens)
        self._init_host_state()
        self._build_host_parts()
        logger.info("kv-canary: attached (%s): %s", config.mode, self.memory_report())

    def _build_device_parts(self, groups: Sequence[GroupSpec], *, max_requests: int, max_context: int,
                            max_batch_tokens: int) -> None:
        """The per-group records, the polled words and counters, the violation rings, the static batch buffers,
        the per-forward launches and the drain (every device buffer but the sweeper's)."""
        config = self.config
        self.groups: dict[str, CanaryGroup] = {
            spec.name: CanaryGroup(spec, config=config, device=self.device, anchor_rows=max_requests) for spec in groups
        }
        keys = [key for g in self.groups.values() for key in g.ring_keys()] + move_tags(list(self.groups.values()))
        self.polled = PolledWords(num_tags=len(set(keys)), counter_shape=LaunchCounters.SHAPE,
                                  num_groups=len(self.groups), device=self.device)
        self.launch_counters = LaunchCounters(self.device, table=self.polled.counters)
        self.rings = ViolationRings(keys=keys, capacity=config.ring_capacity, device=self.device,
                                    write_index=self.polled.write_index)
        self.static = StaticBatch(
            groups=tuple(self.groups), max_rows=max_requests, max_tokens=max_batch_tokens, device=self.device,
        )
        self.launches = ForwardLaunches(
            self.groups, config=config, rings=self.rings, counters=self.launch_counters, static=self.static,
            verify_capacity={n: _verify_capacity(g, max_requests, max_context) for n, g in self.groups.items()},
            owner_span=OWNER_SPAN, plans_disabled=self.polled.plans_disabled,
        )
        self.drain = ViolationDrain(self.rings, synchronous=config.mode == "raise", polled=self.polled,
                                    interval=config.drain_interval)

    def _init_host_state(self) -> None:
        """Host-side state: graphs, the step counters, suspension and the error bookkeeping."""
        self._plans_disabled_seen = [0] * len(self.groups)
        self.sweep_stale = 0  # sweep rows discarded: their slot left the live set during the pass
        self._graphs: Optional[CanaryGraphs] = None
        self._engine_captured = False  # an engine's CUDA graph captured the canary's launches (its buffers are held)
        self.graph_releases = 0  # own graphs dropped for a batch with inputs they lack (`_release_graphs`)
        self._peers = None  # raise_with(): the process group whose ranks raise together
        self._graph_set: Optional[GraphSet] = None  # the bucket this forward's HEAD replayed
        self._swept_this_step = False  # this step's sweep slice already ran with HEAD
        self._sweep_graph: Optional[torch.cuda.CUDAGraph] = None  # the slice alone (engine graphs hold HEAD / TAIL)
        self.canary_errors = 0  # the canary's own failures contained in log mode
        self.unchecked_forwards = 0
        self.suspended: Optional[str] = None  # why checking stopped for good (the canary's own failure)
        self._bracketed = 0  # forwards the engine opened (counted before anything of the canary runs)
        self._drain_failed = False  # a drain raised: the rings are not read again (suspended)
        self._unchecked = False
        self._errors_logged: set[tuple[str, str]] = set()
        self._live_slots: Optional[LiveSlotsProvider] = None
        self._depth = 0
        self._step = 0
        self._engine_forwards = 0
        self._closed = False
        self._static_size = (self.static.max_rows, self.static.max_tokens)

    def _build_host_parts(self) -> None:
        """The sweeper, the step log and attribution, the ledger, the health watchdog and the stats reporter."""
        config = self.config
        self.sweeper = Sweeper(
            self.groups, config=config, rings=self.rings, counters=self.launch_counters, step=self.launches.step,
        )
        self.step_log = StepLog()
        self.attributor = Attributor(log=self.step_log, owner_span=OWNER_SPAN, owners=RecordLookup(
            groups=self.groups, row_history=lambda: self.launches.row_history, sweeper=self.sweeper,
            current_step=lambda: self._step, device=self.device,
            live_slots=lambda: None if self._live_slots is None else self._resolve_live(None),
        ))
        self.identities = self.attributor.identities  # producer identities the adapter issued (runtime/identity.py)
        self.ledger = ViolationLedger(config)
        self.health = HealthWatchdog(config)
        self.stats_reporter = StatsReporter(config.stats_interval)

    # ---- engine-facing -------------------------------------------------------------------
    def set_kv_cache(self, group: str, layers: KvLayers, *, page_size: int = 1, deep_layers: Optional[KvLayers] = None,
                     deep_page_size: Optional[int] = None) -> None:
        """Register group ``group``'s K/V storage per layer (see the module docstring).

        ``layers`` maps a layer id (one of the group's ``layer_ids``) to ``(k, v)``, or is a callable
        doing so; only the layers selected by ``config.real_kv_layers`` are read. ``deep_layers`` (same
        form, every layer, paged by ``deep_page_size``, default ``page_size``): the full storage deep
        fingerprints read, when ``layers`` holds partial copies; default ``layers``.
        """
        self._group(group).set_kv_cache(layers, page_size=page_size, deep_layers=deep_layers,
                                        deep_page_size=deep_page_size)

    def set_live_slots_provider(self, provider: Optional[LiveSlotsProvider]) -> None:
        """Callable returning ``{group name: live slots}`` for the sweep (called once per pass): int64 slot
        indices, or a bool mask of the group's ``num_slots`` entries (True = live; slot 0 is padding either way).
        A mask is the cheaper hand-over for an engine that keeps one (no index list built, none scattered)."""
        self._live_slots = provider

    def release_slots(self, group: str, slots) -> None:
        """The engine freed ``slots`` of ``group`` (int slot indices; call between forwards, as it frees them):
        the rotating sweep stops checking them until the provider lists them live again (the next pass). An
        engine that can reuse a freed slot's bytes within one pass (e.g. a pool whose memory moves between
        groups) must call it, or the pass may check a slot that is free, or reallocated and not yet written."""
        self._check_open()
        g = self._group(group)
        if self._sweeping() and self.suspended is None:
            try:
                self.sweeper.release(g.name, torch.as_tensor(slots, dtype=torch.int64).flatten())
            except KvCanaryError:
                raise  # misuse or bad input, raised on purpose
            except Exception as exc:
                self._fail_between("release_slots", exc)

    @contextlib.contextmanager
    def forward(self, batch: BatchDescription) -> Iterator[None]:
        """Bracket one engine forward: HEAD checks and the sweep slice (`launch_head`) on entry, TAIL checks on exit.

        If the body raises, TAIL is skipped, the step still ends, and the engine's exception
        propagates. Re-entrant use passes through.
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.before_forward(batch)
        try:
            yield
        except BaseException:
            self._finish(run_checks=False)
            raise
        self.after_forward()

    def before_forward(self, batch: BatchDescription) -> None:
        """`begin_step` + `stage` + `launch_head`. Pair with `after_forward`."""
        self._check_open()
        if self._depth:
            self._depth += 1
            return
        self._depth = 1
        self._bracketed += 1
        if self.suspended is not None:  # pass through, counted
            self._unchecked = True
            self.unchecked_forwards += 1
            self._report_suspended()
            return
        try:
            self._check_groups(batch)
            rows = batch.req_pool_indices
            self.begin_step(
                request_ids=batch.request_ids, request_rows=rows if rows.device.type == "cpu" else None,
                forward_kind=batch.forward_kind,
            )
            self.stage(batch)
            self.launch_head()
        except Exception as exc:
            self._contain("before_forward", exc)  # raise mode: re-raised
        except BaseException:
            self._depth = 0
            raise

    def after_forward(self) -> None:
        """`launch_tail` + `end_step` for the open forward.

        In ``raise`` mode raises `CanaryViolationError` listing this step's violations.
        """
        if self._depth == 0:
            raise KvCanaryRuntimeError("kv-canary: after_forward() without a matching before_forward()")
        if self._depth > 1:
            self._depth -= 1
            return
        self._finish(run_checks=True)

    def begin_step(self, *, request_ids: Optional[Sequence[Optional[str]]] = None,
                   request_rows: Optional[Sequence[int]] = None, forward_kind: str = "mixed") -> int:
        """Open the next step (host only, O(1)): log who it serves, set the device step number."""
        self._check_open()
        self._step += 1
        self.step_log.add(self._step, StepEntry(request_ids=request_ids, request_rows=request_rows,
                                                forward_kind=forward_kind))
        self.launches.set_step(self._step)
        return self._step

    def stage(self, batch: BatchDescription) -> None:
        """Copy ``batch`` into the static buffers (device copies only; capturable). A group's `ReadCheck`
        (``GroupBatch.read_check``) is reported here: its disagreeing rows become ``read_table_mismatch`` rows of
        the group's HEAD ring (`runtime.reads`), before the step's HEAD launches; staging one forward twice
        reports them twice."""
        if capturing():
            self._refuse_capture_if_eager("an engine's CUDA graph capture with the canary inside")
            self.static.frozen = True  # an engine graph now reads the buffers: they must not move
            self._engine_captured = True
        elif self._graphs is not None and not self._engine_captured:
            change = self.static.new_inputs(batch)
            if change is not None:
                self._release_graphs(change)
        self.static.stage(batch)
        size = (self.static.max_rows, self.static.max_tokens)
        if size != self._static_size:
            self._static_size = size
            self.launches.resize()
        for name, gb in batch.groups.items():
            if gb.read_check is not None:
                self._report_reads(self.groups[name], gb.read_check)

    def _report_reads(self, g: CanaryGroup, check) -> None:
        tag = g.tag("head")
        ring, write_index = self.rings.ring_for(g.name, tag)
        append_read_rows(ring=ring, write_index=write_index, stamps=self.rings.stamps_for(g.name, tag), tag=tag,
                         head_buf=g.head_buf, num_slots=g.num_slots, check=check, step=self.launches.step,
                         row_arange=self.static.row_arange if check.mismatch.shape[0] <= self.static.max_rows else None)

    def launch_head(self) -> None:
        """Plan, HEAD verify + write, slot records (device only; capturable). Outside an engine's capture the
        forward's sweep slice runs here too, once the step is open and before the records are written (with the
        canary's own graphs on a parallel branch of the HEAD graph); inside one, `end_step` runs it. The slice
        sees the records, canary buffers and KV as the step before left them."""
        # a pass's live set is taken at the end of the step before (`end_step`), when every live slot is written; a
        # pass not started by then (the first step) sweeps in `end_step` instead
        sweeping = self._sweeping() and not capturing() and not self.sweeper.pass_starts()
        if self._graphs is not None:
            self._graph_set = self._graphs.pick(self.static.active)
            if sweeping and self._graph_set.head_sweep is not None:
                self._graph_set.head_sweep.replay()
                self._swept()
            else:
                self._graph_set.head.replay()
        else:
            self.launches.head(on_open=self._sweep_slice_now if sweeping else None)

    def _sweep_slice_now(self) -> None:
        self.sweeper.slice_device()
        self._swept()

    def _swept(self) -> None:
        self.sweeper.slices_run += 1
        self._swept_this_step = True

    def launch_tail(self, *, run_checks: bool = True) -> None:
        """TAIL verify + write, row stamps (device only; capturable). ``run_checks=False``: stamps only."""
        if self._graphs is not None:
            graphs = self._graph_set  # the bucket HEAD replayed
            (graphs.tail if run_checks else graphs.stamps).replay()
        else:
            self.launches.tail(run_checks=run_checks)

    def _refuse_capture_if_eager(self, what: str) -> None:
        """Never capture the twins (they read device values on the host): a ``kv-canary:`` refusal on the eager
        fallback path."""
        if self.device_path.degraded:
            raise KvCanaryRuntimeError(self.device_path.refusal(what))

    def _sweeping(self) -> bool:
        return self._live_slots is not None and self.sweeper.interval > 0

    def _start_pass_if_due(self) -> None:
        """A rotating pass starts with the next slice: refresh its live set (host, once per pass)."""
        if self.sweeper.pass_starts():
            self.sweeper.refresh_live(self._resolve_live(None))

    def warm_up(self, batch: BatchDescription) -> bool:
        """Compile the per-forward kernels now, before serving, instead of in the first forwards (Triton compiles each
        kernel on first use: about a minute on a cold machine). ``batch``: an empty forward (no rows, no tokens)
        holding the engine's by-reference tables (``req_to_token`` per group, ``token_table``), as `stage` takes
        them. Runs every bucket's HEAD and TAIL on it (all padding: nothing planned, written or verified) and one
        `launch_sweep` chunk on an empty live set, and restores the counters and cursors they moved: no record,
        counter, step or violation changes. Call it between
        forwards. Returns False (nothing run) where no kernel compiles: the torch twins, a degraded device path."""
        self._check_open()
        if self._depth:
            raise KvCanaryRuntimeError("kv-canary: warm_up() inside an open forward")
        if batch.batch_size or batch.num_tokens:
            raise KvCanaryValueError(f"kv-canary: warm_up() takes an empty batch, got {batch.batch_size} rows / "
                                     f"{batch.num_tokens} tokens")
        if dispatch.triton_backend(self.device) is None or self.device_path.degraded or self.suspended is not None:
            return False
        self.stage(batch)
        run_empty_buckets(launches=self.launches, sweeper=self.sweeper, static=self.static, counters=self.launch_counters,
                          eager_sizes=True)
        self.sweeper.warm_masks()  # the explicit sweep's kernels (`launch_sweep`)
        return True

    def capture_graphs(self, *, error_mode: str = "global") -> None:
        """Capture the canary's own per-forward device work into CUDA graphs (CUDA only), replayed by
        `launch_head`, `launch_tail` and the sweep slice from now on: a few host calls per forward whatever
        the batch. Call it after at least one forward (the by-reference tables must be known) and outside
        any open forward; the static buffers no longer grow afterwards. ``error_mode``: the captures'
        ``capture_error_mode`` (``"thread_local"`` where other threads of the engine use CUDA meanwhile)."""
        self._check_open()
        self._refuse_capture_if_eager("capture_graphs()")
        if self._depth:
            raise KvCanaryRuntimeError("kv-canary: capture_graphs() inside an open forward")
        if not self.static.inputs:
            raise KvCanaryRuntimeError("kv-canary: capture_graphs() needs one forward first (it reads the engine's tables)")
        self._flush()
        try:
            self._graphs = CanaryGraphs(
                launches=self.launches, sweeper=self.sweeper, static=self.static, counters=self.launch_counters,
                error_mode=error_mode,
            )
        except BaseException:
            self.static.frozen = False  # no graph holds the buffers: the eager path goes on as before
            raise

    def _release_graphs(self, why: str) -> None:
        """Drop the canary's own graphs: a batch needs inputs they were captured without (``why``). HEAD / TAIL
        launch eagerly from this forward on, until the adapter calls `capture_graphs` again (`graph_releases`
        counts the drops)."""
        self._graphs = self._graph_set = None
        self.static.frozen = False
        self.graph_releases += 1
        logger.info("kv-canary: %s; the canary's own CUDA graphs are released (eager launches until captured again)", why)

    @property
    def replays_own_graphs(self) -> bool:
        """True once `capture_graphs` succeeded: HEAD / TAIL replay the canary's own CUDA graphs."""
        return self._graphs is not None

    def capture_sweep_graph(self) -> bool:
        """Capture the rotating sweep slice alone into a CUDA graph that `end_step` replays (CUDA only): for an
        engine that captures HEAD / TAIL inside its own graphs, where the slice would otherwise be launched from
        Python every step. Call it between forwards, after one step has swept; False when there is no sweep."""
        self._check_open()
        self._refuse_capture_if_eager("capture_sweep_graph()")
        if self._depth:
            raise KvCanaryRuntimeError("kv-canary: capture_sweep_graph() inside an open forward")
        if not self._sweeping():
            return False
        self._sweep_graph = capture_sweep_slice(self.sweeper, self.static.device)
        return True

    def end_step(self) -> None:
        """Sweep slice (unless HEAD ran it), the next pass's live set when one starts, non-blocking drain, health,
        stats (host); raises in ``raise`` mode."""
        try:
            if self._swept_this_step:
                self._swept_this_step = False
            elif self._sweeping():
                self._start_pass_if_due()
                sweep = self._graphs.sweep if self._graphs is not None else self._sweep_graph
                if sweep is not None:
                    sweep.replay()
                    self.sweeper.slices_run += 1
                else:
                    self.sweeper.slice()
            if self._sweeping():
                self._start_pass_if_due()  # the next slice starts a pass: its live set as this step leaves it
            for harvest in self.drain.end_step(self._step):
                self._report(harvest)
            self._grow_disabled_plans()
        finally:
            self._depth = 0
        forwards = max(self._engine_forwards, self._step)
        if self.health.due(forwards):
            self.health.observe(engine_forwards=forwards, canary_forwards=self._step, launches=self._launches_seen())
        self.stats_reporter.maybe_report(self._step, self.stats)
        self._raise_if_needed(self._step)

    def note_engine_forward(self, count: int = 1) -> None:
        """Count forwards the engine ran, from outside the bracket (feeds the health watchdog)."""
        self._engine_forwards += count
        if self.suspended is not None:  # the suspension is the report; the watchdog would repeat it
            return
        self.health.observe(
            engine_forwards=self._engine_forwards, canary_forwards=self._step, launches=self._launches_seen()
        )

    def sweep(self, live: Optional[Mapping[str, torch.Tensor]] = None) -> SweepReport:
        """Verify every live slot now (default: from the live-slots provider); drains at once."""
        self._check_open()
        if self._depth:
            raise KvCanaryRuntimeError("kv-canary: sweep() inside an open forward; sweeps run between forwards")
        if self.suspended is not None:
            return SweepReport(step=self._step)
        self._flush()
        if self.suspended is not None:
            return SweepReport(step=self._step)
        try:
            self.rings.mark()
            report = self.sweeper.run(self._resolve_live(live))
        except KvCanaryError:
            raise  # misuse or bad input, raised on purpose
        except Exception as exc:
            self._fail_between("sweep", exc)
            return SweepReport(step=self._step)
        self._flush()
        self._raise_if_needed(self._step)
        return report

    def launch_sweep(self, masks: Mapping[str, torch.Tensor],
                     windows: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
        """`sweep` without waiting: verify the live slots of each group's bool mask (``[num_slots]`` on the device,
        True = live) now, between forwards, with no host read, in a window of the slot space (``windows[group]`` =
        ``(lo, hi)``, else the group's next ``sweep_max_bytes`` window: docs/design.md §4.4); the rows are drained by
        the following steps (or `violations()` / `counters()`), named from the slot records. `Sweeper.last` reads the
        counts when asked."""
        self._check_open()
        if self._depth:
            raise KvCanaryRuntimeError("kv-canary: launch_sweep() inside an open forward; sweeps run between forwards")
        if self.suspended is not None:
            return
        try:
            self.sweeper.run_masks(masks, self._step, windows=windows)
        except KvCanaryError:
            raise  # misuse or bad input, raised on purpose
        except Exception as exc:
            self._fail_between("sweep", exc)

    # ---- KV moves (runtime/moves.py: copy-on-write, offload / restore, transfer) -----------
    def copy_slots(self, group: str, src, dst, **kwargs: object) -> MoveReport:
        """The engine copied the KV of ``src[i]`` to ``dst[i]``: move the canary state with it (`SlotMoves.copy_slots`).
        Suspended (or failing, ``log`` mode): nothing moves and the report is empty."""
        return self._move("copy", lambda: self.moves.copy_slots(group, src, dst, **kwargs))  # type: ignore[arg-type]

    def export_records(self, group: str, slots) -> torch.Tensor:
        """The records of ``slots`` as an int64 export to carry beside the KV (`SlotMoves.export_records`).
        Suspended (or failing, ``log`` mode): a well-formed export of zero records (the canary checks nothing more)."""
        try:
            if self.suspended is None:
                return self.moves.export_records(group, slots)
        except KvCanaryError:
            raise  # misuse or bad input: raised on purpose, before anything changed
        except Exception as exc:
            self._fail_between("export_records", exc)
        return self._empty_export(group, slots)

    def import_records(self, group: str, slots, records: torch.Tensor, verify: bool = True, **kwargs: object) -> MoveReport:
        """Install an export into ``slots`` and verify the KV there at once (`SlotMoves.import_records`).
        Suspended (or failing, ``log`` mode): nothing is installed and the report is empty."""
        return self._move("import", lambda: self.moves.import_records(group, slots, records, verify, **kwargs))  # type: ignore[arg-type]

    def _move(self, kind: str, run: Callable[[], MoveReport]) -> MoveReport:
        try:
            if self.suspended is None:
                return run()
        except KvCanaryError:
            raise  # misuse or bad input (raised on purpose, before anything changed), or a violation in raise mode
        except Exception as exc:
            self._fail_between(f"{kind}_slots" if kind == "copy" else "import_records", exc)
        return MoveReport(step=self._step, kind=kind, label="suspended", moved=0, verified=0, violations=())

    def _empty_export(self, group: str, slots) -> torch.Tensor:
        from kvcanary.ops.copy_format import canary_records_shape, write_canary_records_header
        from kvcanary.runtime.moves import record_tables

        n = len(slots) if not isinstance(slots, torch.Tensor) else int(slots.numel())
        b = len(record_tables(self._group(group)))
        out = torch.zeros(canary_records_shape(n, b), dtype=torch.int64, device=self.device)
        write_canary_records_header(out, num_records=n, num_buffers=b)
        return out

    @property
    def moves(self) -> SlotMoves:
        moves = self.__dict__.get("_moves")
        if moves is None:
            moves = self.__dict__["_moves"] = SlotMoves(self)
        return moves

    # ---- user-facing ---------------------------------------------------------------------
    def violations(self) -> list[Violation]:
        """Every violation drained so far (oldest first; bounded by the ledger's keep limit)."""
        self._flush()
        return self.ledger.violations()

    def counters(self) -> dict[str, object]:
        """Exact counts: total, by reason label, by launch tag name, ring overflow, checked forwards."""
        self._flush()
        out = self.ledger.counters()
        out["checked_forwards"] = self.checked_forwards()
        out["engine_forwards"] = self.engine_forwards
        out["coverage"] = self.coverage()
        out["suspended"] = self.suspended
        out["device_path"] = self.device_path.path
        if self.config.jitter:
            snap = self.launch_counters.snapshot()
            out["jitter"] = {"stalls": snap.jitter_stalls, "cycles": snap.jitter_cycles}
        return out

    @property
    def engine_forwards(self) -> int:
        """Forwards the engine ran: those it reported (`note_engine_forward`) or, if more, those it bracketed —
        counted before any of the canary's work, so a suspended or failing canary cannot silence them."""
        return max(self._engine_forwards, self._bracketed)

    def checked_forwards(self, stats: Optional[CanaryStats] = None) -> int:
        """Forwards whose HEAD checks ran on the device (graph replays included): read now (a device read), or as
        ``stats`` counted them."""
        if stats is not None:
            return stats.checked_forwards
        return self.launch_counters.snapshot().verify_kernels[self._head_tag()] // self._head_launches()

    def _head_tag(self) -> int:
        return int(next(iter(self.groups.values())).tag("head"))

    def _head_launches(self) -> int:
        """HEAD verify launches per forward under `_head_tag`: one per group of the first group's kind (the groups
        of one kind share its counters)."""
        kind = next(iter(self.groups.values())).kind
        return sum(g.kind == kind for g in self.groups.values())

    def stats(self, *, wait: bool = True) -> CanaryStats:
        """Forwards, slots verified / written, kernel launches, sweeps, violations, memory. Inside an open forward the
        rings are not drained (the HEAD rows would leave before TAIL stamps them): violations found since the last
        drain count from the next call on.

        ``wait=False`` (CUDA, asynchronous drain): no device read — the counters as the drain last read them back,
        at the end of step ``forwards`` (a few steps behind the engine), and the violations drained so far; a
        periodic reader on the serving path uses it (no stall). Elsewhere it is ``wait=True``."""
        if not wait and self.drain.asynchronous:
            return self._gather_stats(polled=True)
        if not self._depth:
            self._flush()
        return self._gather_stats()

    def memory_bytes(self) -> int:
        """Device bytes the canary allocated (buffers, slot records, static batch, plans, rings, counters)."""
        return (
            sum(g.memory_bytes() for g in self.groups.values()) + self.static.memory_bytes()
            + self.launches.memory_bytes() + self.rings.memory_bytes() + self.launch_counters.memory_bytes()
        )

    def memory_report(self) -> str:
        slots = sum(g.num_slots for g in self.groups.values())
        per_slot = sum(g.bytes_per_slot() * g.num_slots for g in self.groups.values()) / max(slots, 1)
        return (
            f"{self.memory_bytes() / 2**20:.2f} MiB on {self.device} for {slots} slots in "
            f"{len(self.groups)} group(s) ({per_slot:.0f} B/slot + context anchors, static buffers, plans and rings)"
        )

    def close(self, *, final_sweep: bool = True) -> CanaryStats:
        """Drain what is left and return the final stats. Idempotent.

        With ``final_sweep`` (default), when the rotating sweep is on (a live-slots provider and
        ``sweep_interval > 0``) and no forward is open, first verify every live slot (`sweep`): damage to cached KV
        that no later read or rotating slice reached is reported before the session ends. Skip it when the slots'
        records cannot be trusted any more (e.g. forwards ran unchecked). In ``raise`` mode a violation it finds is
        raised after the canary is closed; a failure of the sweep itself (an engine tearing down) is logged and
        counted in ``coverage()["canary_errors"]``, never raised."""
        if self._closed:
            return self._gather_stats()
        found: Optional[CanaryViolationError] = None
        try:
            if final_sweep and self._sweeping() and self._depth == 0:
                counted = self.canary_errors
                try:
                    self.sweep()
                except CanaryViolationError as exc:
                    found = exc
                except Exception as exc:  # noqa: BLE001 — closing must not fail on a provider gone with its engine
                    self.canary_errors = counted + 1  # once, whether or not sweep() counted it (raise mode)
                    logger.error("kv-canary: the final sweep at close failed (%s: %s); closed without it",
                                 type(exc).__name__, exc)
        finally:
            self._flush()
            try:
                self.ledger.close()
            except Exception as exc:
                self._fail_between("close", exc)
            self._closed = True
        if found is not None:
            raise found
        return self._gather_stats()

    def __enter__(self) -> "Canary":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def step(self) -> int:
        """Forwards bracketed so far."""
        return self._step

    # ---- internals -----------------------------------------------------------------------
    def _finish(self, *, run_checks: bool) -> None:
        if self._unchecked:  # the HEAD half failed (log mode): this forward stays unchecked
            self._unchecked = False
            self._depth = 0
            return
        try:
            self.launch_tail(run_checks=run_checks)
            self.end_step()
        except CanaryViolationError:
            raise
        except Exception as exc:
            self._depth = 0
            self._contain("after_forward", exc)
        except BaseException:
            self._depth = 0
            raise

    def _contain(self, where: str, exc: Exception) -> None:
        """The canary failed inside a bracket: suspend it (module docstring). ``log`` mode: log once, count, the
        forward proceeds unchecked. ``raise`` mode: raise one `KvCanaryError` (``exc`` itself when it is one)."""
        if self.config.mode != "raise":
            self.unchecked_forwards += 1
            self._unchecked = where == "before_forward"
        else:
            self._depth = 0
        self._fail_between(where, exc)

    def _fail_between(self, where: str, exc: Exception) -> None:
        """The canary failed in ``where``: count it and suspend; ``log`` mode logs it once at ERROR and returns,
        ``raise`` mode raises it as a `KvCanaryError`."""
        if isinstance(exc, (CanaryViolationError, CanaryHealthError)):
            raise exc  # the canary working as configured (raise mode), not a failure of it
        self.canary_errors += 1
        first = self.suspended is None
        if first:
            self.suspended = f"{where}: {type(exc).__name__}: {exc}"
        if self.config.mode == "raise":
            if isinstance(exc, KvCanaryError):
                raise exc
            raise KvCanaryRuntimeError(f"kv-canary: the canary failed in {where} ({type(exc).__name__}: {exc}); "
                                       "it is suspended (checks nothing more)") from exc
        key = (where, type(exc).__name__)
        if key not in self._errors_logged:
            self._errors_logged.add(key)
            logger.error("kv-canary: %s failed (%s: %s); the canary is suspended: the engine keeps serving, its "
                         "forwards run unchecked (log mode; counted in unchecked_forwards, checked_forwards < "
                         "engine_forwards)", where, type(exc).__name__, exc)

    def _report_suspended(self) -> None:
        """The periodic stats line goes on while suspended (it says so), on the engine's forwards."""
        interval = self.stats_reporter.interval
        if interval > 0 and self._bracketed % interval == 0:
            logger.warning(self._gather_stats().line())

    def coverage(self) -> dict[str, object]:
        """What was *not* checked (all zero / empty in a healthy run); a host read of one device counter."""
        return {
            "unchecked_forwards": self.unchecked_forwards,
            "canary_errors": self.canary_errors,
            "plans_disabled": int(self.launches.plans_disabled.sum().item()),
            "write_assert_skipped": self.launches.write_assert_skipped,
            "unhashed_groups": sorted(n for n, g in self.groups.items() if g.hash_mode != 0 and not g.hashing),
            "sweep_stale": self.sweep_stale,
            "step_log_forgotten": self.step_log.forgotten,
            "sink_errors": self.ledger.sink_errors,
        }

    def _launches_seen(self) -> int:
        """Kernel launches as last read back by the drain (verify + write kernel counters)."""
        table = self.drain.watched[0]
        return sum(table[LaunchCounters.ROW_WIDTH * r + t] for r in (1, 3) for t in range(LaunchCounters.ROW_WIDTH))

    def _grow_disabled_plans(self) -> None:
        """A verify plan that overflowed its capacity (seen a step or more late) grows 4x for later steps."""
        disabled = self.drain.watched[1]
        if disabled == self._plans_disabled_seen:
            return
        for (name, seen), now in zip(zip(self.groups, self._plans_disabled_seen), disabled):
            if now > seen:
                self.launches.grow_verify_plan(name)
        self._plans_disabled_seen = list(disabled)

    def _report(self, harvest: Harvest) -> None:
        attributed = self.attributor.attribute_harvest(harvest)
        self.sweep_stale += attributed.stale
        self.ledger.record(counts=attributed.counts, dropped=harvest.dropped, violations=attributed.violations)

    def _flush(self) -> None:
        if self._drain_failed:
            return  # what was drained before stands
        try:
            for harvest in self.drain.flush(self._step):
                self._report(harvest)
        except (CanaryViolationError, CanaryHealthError):
            raise
        except Exception as exc:
            self._drain_failed = True
            self._fail_between("drain", exc)

    def _gather_stats(self, polled: bool = False) -> CanaryStats:
        """``polled``: from the drain's last read-back (`stats` with ``wait=False``), else read now."""
        counters, plans_disabled, forwards = self.launch_counters, None, self._step
        if polled:
            counters, forwards = LaunchCounters.from_words(self.drain.watched[0]), self.drain.watched_step
            plans_disabled = sum(self.drain.watched[1])
        return CanaryStats.gather(
            forwards=forwards, counters=counters, ledger=self.ledger, sweeper=self.sweeper, passes=not polled,
            head_tag=self._head_tag() if self.groups else None,
            head_launches=self._head_launches() if self.groups else 1,
            capacity_growths=self.static.growths + self.launches.plan_growths, write_assert_skipped=self.launches.write_assert_skipped,
            plans_disabled=int(self.launches.plans_disabled.sum().item()) if plans_disabled is None else plans_disabled,
            memory_bytes=self.memory_bytes(), health=self.health, sweep_stale=self.sweep_stale,
            engine_forwards=self.engine_forwards, unchecked_forwards=self.unchecked_forwards,
            state=self._state(),
        )

    def _state(self) -> str:
        """``checking``, ``eager_fallback`` (checking on the slow twins path) or ``suspended: <cause>``."""
        if self.suspended is not None:
            return f"suspended: {self.suspended}"
        return "eager_fallback" if self.device_path.degraded else "checking"

    def raise_with(self, group) -> None:
        """``raise`` mode across ranks (tensor parallelism): at the end of every step (and sweep) the ranks of the
        ``torch.distributed`` process ``group`` (gloo, or NCCL: `runtime.fail_together.FailTogether`) sum how many violations
        each found — one all-reduce of one int64 — and every rank raises `CanaryViolationError` together, a rank that
        found none naming how many the others found. So a tensor-parallel group fails in one step instead of rank by
        rank. Every rank of the group must run the same forwards and sweeps with its canary checking (a suspended
        rank no longer answers). ``None`` turns it off."""
        if group is not None and self.config.mode != "raise":
            raise KvCanaryValueError(f"kv-canary: raise_with() needs mode='raise', the canary runs in mode {self.config.mode!r}")
        self._peers = None if group is None else FailTogether(group)

    def _raise_if_needed(self, step: int) -> None:
        if self.config.mode != "raise":
            return
        found = self.ledger.take_unraised()
        total = self._peers.agree(len(found)).violations if self._peers is not None else 0
        if found or total:
            raise CanaryViolationError(found, step=step, elsewhere=total)

    def _check_groups(self, batch: BatchDescription) -> None:
        if batch.groups.keys() == self.groups.keys():
            return
        have, want = set(batch.groups), set(self.groups)
        if have != want:
            raise KvCanaryValueError(
                f"kv-canary: BatchDescription.groups has {sorted(have)}, the canary's groups are {sorted(want)}"
            )

    def _resolve_live(self, live: Optional[Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
        if live is None:
            if self._live_slots is None:
                raise KvCanaryValueError("kv-canary: sweep() needs live slots: pass them or call set_live_slots_provider()")
            live = self._live_slots()
        unknown = set(live) - set(self.groups)
        if unknown:
            raise KvCanaryValueError(f"kv-canary: live slots for unknown group(s) {sorted(unknown)}; groups are {sorted(self.groups)}")
        for name, slots in live.items():
            n = self.groups[name].num_slots
            if slots.dtype == torch.bool and tuple(slots.shape) != (n,):
                raise KvCanaryValueError(f"kv-canary: live mask of group {name!r} must have shape ({n},) (one entry per "
                                         f"slot), got {tuple(slots.shape)}")
        return live

    def _group(self, name: str) -> CanaryGroup:
        try:
            return self.groups[name]
        except KeyError:
            raise KvCanaryValueError(f"kv-canary: no group {name!r}; groups are {sorted(self.groups)}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise KvCanaryRuntimeError("kv-canary: this Canary is closed")


def _check_arguments(config: CanaryConfig, groups: Sequence[GroupSpec], **sizes: object) -> None:
    """`Canary`'s refusals, before anything is built: mode ``none``, no groups, duplicate group names, a size
    (``max_requests``, ``max_context``, ``max_batch_tokens``, in that order) that is not a positive integer."""
    if not config.enabled:
        raise KvCanaryValueError("kv-canary: Canary needs mode 'log' or 'raise'; mode 'none' attaches nothing (use create_canary)")
    if not groups:
        raise KvCanaryValueError("kv-canary: Canary needs at least one GroupSpec")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise KvCanaryValueError(f"kv-canary: GroupSpec names must be unique, got {names}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KvCanaryValueError(f"kv-canary: Canary {name} must be a positive integer, got {value!r}")


def _verify_capacity(g: CanaryGroup, max_requests: int, max_context: int) -> int:
    """Verify entries one forward may need: every row's cached prefix (window), capped at 4 x the slots
    (prefix sharing lets entries exceed the slot count; a plan beyond capacity is disabled and counted)."""
    span = g.window if g.window else max_context
    return max(1, min(max_requests * span, 4 * g.num_slots))
