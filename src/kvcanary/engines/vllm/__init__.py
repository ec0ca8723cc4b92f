"""vLLM: the canary as a KV connector, for vLLM 0.26.0 through 0.32.0 (any other version is refused).

Turn it on with one flag — the KV-transfer config naming the connector::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvCanaryConnector",
        "kv_connector_module_path": "kvcanary.engines.vllm.connector", "kv_role": "kv_both"}'

    LLM(model=..., kv_transfer_config=kvcanary.engines.vllm.kv_transfer_config(mode="log"))

Options go in ``kv_connector_extra_config={"kvcanary": {...}}`` or ``KVCANARY_*`` environment variables.

Why a KV connector (and not a general plugin). vLLM offers two extension points that need no
patching. A ``vllm.general_plugins`` entry point only runs a function at start-up in every process;
reaching the forward from there means wrapping vLLM methods — patching. The KV-connector API
(``KVConnectorBase_V1``) is loaded by name from ``kv_transfer_config`` in the scheduler *and* in
every worker, and its documented calls are exactly the canary's bracket: the scheduler side builds
per-step metadata from the ``SchedulerOutput`` (request ids, tokens, preemptions, finished requests)
and sees the block pool; the worker side gets the KV tensors (``register_kv_caches``), a call inside
the forward context right before the model runs (``bind_connector_metadata``, with the attention
metadata that the kernels will use: block tables, slot mappings, sequence lengths) and one right
after it (``wait_for_save``); stats flow back to the user's process through vLLM's own KV-connector
stats (log line, Prometheus ``vllm:kv_canary_*``), and per-request verdicts through
``kv_transfer_params``. It composes with other connectors through vLLM's ``MultiConnector``. What it
does not give is the model runner (for the batch's request order and input ids): the worker finds it
once by walking the garbage collector's objects — read only; nothing in vLLM is replaced or wrapped.

The canary lives in each worker (one `Canary` per rank, checking that rank's KV shard); the scheduler
side only ships the scheduler's record of each request's tokens, so the worker can compare what the
engine feeds and stores with what the scheduler meant.

Module map: `compat` (version pin), `layout` (KV cache groups, ISA-probed token-major views of the CPU
cache), `forward_view` (attention metadata + model runner batch -> `BatchDescription`, live slots),
`config` (the KV-transfer settings, no vLLM import), `connector` (`KvCanaryConnector`, metadata), `metrics`
(KV-connector stats and Prometheus), `plugin` (connector names for vLLM's factory). The fault-injecting connector for
tests and the demo, the tiny workload and the live-engine experiments live with the other fault tooling:
`kvcanary.faults.vllm`, `kvcanary.faults.vllm_workload`, `kvcanary.faults.vllm_experiments` (the old
``kvcanary.engines.vllm.faults`` / ``.workload`` / ``.experiments`` paths still import, with a `DeprecationWarning`).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from kvcanary.engines.vllm.compat import MAX_VLLM, MIN_VLLM, SUPPORTED_VLLM, check_vllm_version
from kvcanary.engines.vllm.config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    ON_VIOLATION,  # noqa: F401  (re-exported: connector.py reads it here)
    canary_transfer_config,
    connector_entry,
)

# the fault injector's connector names (kept for compatibility; they live with it, in `kvcanary.faults.vllm`)
FAULT_CONNECTOR_NAME = "KvCanaryFaultConnector"
FAULT_CONNECTOR_MODULE = "kvcanary.faults.vllm"


def kv_transfer_config(*, faults: Optional[list[dict[str, Any]]] = None, **options: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` that turns the canary on (pass it to ``LLM(...)`` or, as JSON, to
    ``--kv-transfer-config``). ``options``: `CanaryConfig` fields and ``max_requests`` / ``max_context``.

    ``on_violation`` (an option): ``log`` (default: report, keep serving), ``abort`` (the running requests holding
    corrupted blocks finish with finish_reason ``error``; the blocks leave the prefix cache), ``recompute`` (they
    recompute those blocks), ``raise`` (the worker raises: tests). abort / recompute also set vLLM's
    ``kv_load_failure_policy``.

    ``faults`` (deprecated; tests and the demo only): use
    ``kvcanary.faults.vllm.faulted_kv_transfer_config(faults, **options)``, which builds the same config (the fault
    injector before the canary, through vLLM's ``MultiConnector``). Passing it warns (`DeprecationWarning`) and
    delegates there (which imports vLLM).
    """
    if faults is None:
        return canary_transfer_config(**options)
    warnings.warn("kv-canary: kv_transfer_config(faults=...) is deprecated; use "
                  "kvcanary.faults.vllm.faulted_kv_transfer_config(faults, **options)",
                  DeprecationWarning, stacklevel=2)
    if not faults:
        return canary_transfer_config(**options)
    from kvcanary.faults.vllm import faulted_kv_transfer_config  # lazy: the engines layer does not import faults

    return faulted_kv_transfer_config(faults, **options)


__all__ = [
    "SUPPORTED_VLLM", "MIN_VLLM", "MAX_VLLM", "CONNECTOR_NAME", "CONNECTOR_MODULE", "check_vllm_version", "connector_entry",
    "kv_transfer_config",
]
