"""How the canary's counts leave the worker: vLLM's KV-connector stats and Prometheus hooks.

Each worker returns a `KvCanaryStats` delta per step (``get_kv_connector_stats``); vLLM sums the
deltas of all workers (tensor-parallel ranks included: `aggregate`), hands them to the scheduler and
then to the stat loggers of the user's process: the periodic ``KV Transfer metrics: kv_canary_...``
log line (`reduce`) and the Prometheus counters of `KvCanaryPromMetrics` (``vllm:kv_canary_*``,
visible in ``/metrics`` of ``vllm serve`` and in ``LLM.get_metrics()`` when stats are on).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# plain counters summed across steps and ranks (every value an int)
COUNTS = (
    "forwards",  # engine forwards the adapter bracketed
    "full_graph_forwards",  # of those, forwards vLLM replayed from a FULL CUDA graph (V2 model runner)
    "canary_graph_forwards",  # forwards whose canary work replayed the canary's own CUDA graphs (CUDA)
    "checked_forwards",  # forwards whose HEAD checks ran (counted by the canary)
    "unchecked_forwards",  # forwards that ran while the worker's canary was suspended (its own failure)
    "canary_errors",  # failures of the canary itself (log mode: each suspends the worker's canary)
    "slots_verified",  # HEAD + TAIL + sweep slot verifications
    "slots_written",  # HEAD + TAIL record writes
    "violations",
    "sweeps",
    "prefix_hits",  # first forwards that started past position 0 (prefix cache)
    "chunked_prefills",  # forwards continuing a chunked prefill
    "resumed",  # first forwards after a preemption
    "same_step_shares",  # rows reading prefix blocks another row writes in the same forward
    "draft_tokens",  # speculative decoding: draft tokens the target model wrote and verified
    "slots_reused",  # slots written again after their block was freed and reallocated (eviction, reuse)
    "canary_microseconds",  # wall time the worker spent in the canary (bracket + sweeps), summed over ranks
)


class KvCanaryStats(KVConnectorStats):
    """``data``: the `COUNTS` plus ``by_reason`` (reason label -> count); deltas since the last step."""

    def reset(self) -> None:
        self.data = {}

    def __getitem__(self, key: str) -> Any:
        # vLLM 0.26's MultiConnector Prometheus hook reads ``stats["data"]``, which is a dict only after the stats
        # crossed a process boundary; with the engine core in-process it is this object
        if key == "data":
            return self.data
        raise KeyError(key)

    def aggregate(self, other: KVConnectorStats) -> "KvCanaryStats":
        merged: dict[str, Any] = dict(self.data)
        for key, value in other.data.items():
            if isinstance(value, dict):
                inner = dict(merged.get(key, {}))
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
                merged[key] = inner
            else:
                merged[key] = merged.get(key, 0) + value
        return KvCanaryStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {f"kv_canary_{k}": int(self.data.get(k, 0)) for k in COUNTS}
        for reason, n in sorted(self.data.get("by_reason", {}).items()):
            out[f"kv_canary_{reason}"] = int(n)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTS)


class KvCanaryPromMetrics(KVConnectorPromMetrics):
    """``vllm:kv_canary_<count>`` counters per engine, and ``vllm:kv_canary_violations_by_reason``
    labelled by reason."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:kv_canary_{key}", documentation=f"kvcanary: {key.replace('_', ' ')}",
                                  labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key in COUNTS
        }
        self.by_reason = self._counter_cls(
            name="vllm:kv_canary_violations_by_reason", documentation="kvcanary: violations by reason label",
            labelnames=labelnames + ["reason"],
        )
        self.labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key in COUNTS:
            value = int(transfer_stats_data.get(key, 0))
            if value:
                self.counters[key][engine_idx].inc(value)
        for reason, n in transfer_stats_data.get("by_reason", {}).items():
            self.by_reason.labels(*self.labelvalues[engine_idx], reason).inc(int(n))
