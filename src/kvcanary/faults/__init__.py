"""Fault injection (docs/design.md §6): injectors that break an engine the way real bugs do, a ledger entry
per injection, a token oracle, and detection accounting (which injections the canary caught, how
late, with which checks).

Layers: ``kvcanary.faults`` sits beside the engine adapters, above the runtime; the canary never
knows about it.
"""
from kvcanary.faults.accounting import Outcome, account, summarize
from kvcanary.faults.ledger import CHECK_OF_REASON, FAULT_CLASSES, FaultLedger, Injection
from kvcanary.faults.oracle import TokenOracle, oracle_token

__all__ = ["Outcome", "account", "summarize", "CHECK_OF_REASON", "FAULT_CLASSES", "FaultLedger", "Injection",
           "TokenOracle", "oracle_token"]
