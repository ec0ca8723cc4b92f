"""The KV-transfer settings that name the canary's connector (no vLLM import; re-exported by `kvcanary.engines.vllm`).

A module of its own so the fault injector's config (`kvcanary.faults.vllm.faulted_kv_transfer_config`) can build on
the canary's entry without importing the package, whose deprecated ``kv_transfer_config(faults=...)`` imports it.
"""
from __future__ import annotations

from typing import Any

#: ``on_violation`` -> the ``kv_load_failure_policy`` vLLM needs (kept equal to `connector.ON_VIOLATION`, which
#: imports vLLM)
ON_VIOLATION = {"log": None, "abort": "fail", "recompute": "recompute", "raise": None}

CONNECTOR_NAME = "KvCanaryConnector"
CONNECTOR_MODULE = "kvcanary.engines.vllm.connector"


def connector_entry(**options: Any) -> dict[str, Any]:
    """One connector's KV-transfer settings: the canary, with `CanaryConfig` / adapter ``options``."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvcanary": dict(options)} if options else {},
    }


def failure_policy(options: dict[str, Any]):
    """vLLM's ``kv_load_failure_policy`` for the canary ``options`` (``on_violation``), or None (vLLM's default)."""
    return ON_VIOLATION.get(options.get("on_violation", "log"))


def canary_transfer_config(**options: Any) -> dict[str, Any]:
    """The canary alone as a ``kv_transfer_config`` (`kvcanary.engines.vllm.kv_transfer_config` without faults)."""
    canary = connector_entry(**options)
    policy = failure_policy(options)
    if policy is not None:
        canary["kv_load_failure_policy"] = policy  # vLLM's failed-block path answers abort / recompute
    return canary
