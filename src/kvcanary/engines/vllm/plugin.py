"""``vllm.general_plugins`` entry point: registers the canary's connector names in every vLLM process.

vLLM runs general plugins at start-up in the API server, the engine core and each worker. This one
only adds two names to ``KVConnectorFactory`` (lazy: nothing is imported until a config names them),
so ``--kv-transfer-config '{"kv_connector": "KvCanaryConnector", "kv_role": "kv_both"}'`` works
without a module path, and vLLM's ``MultiConnector`` (which looks sub-connectors up by name when it
merges their stats) can compose the canary with other connectors. It changes nothing else.
"""
from __future__ import annotations

CONNECTORS = {
    "KvCanaryConnector": "kvcanary.engines.vllm.connector",
    "KvCanaryFaultConnector": "kvcanary.faults.vllm",
}


def register() -> None:
    """Register the connector names (idempotent; a no-op where vLLM's factory is missing)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return
    for name, module in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
