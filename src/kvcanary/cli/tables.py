"""Text tables the demos share: the per-fault rows (caught?, latency, request, reasons, what was injected)."""
from __future__ import annotations


def fault_lines(faults: list[dict], *, request_width: int, forward_key: str) -> list[str]:
    """Header and rows for ``faults`` (each with name, caught, latency_forwards, request, reasons and an
    ``injected`` dict whose ``forward_key`` names the forward it was injected at)."""
    lines = [f"{'fault':<38} {'caught':>6}  {'latency':>7}  {'request':<{request_width}} reasons"]
    for f in faults:
        lat = "-" if f["latency_forwards"] is None else f"{f['latency_forwards']} fwd"
        lines.append(f"{f['name']:<38} {'yes' if f['caught'] else 'NO':>6}  {lat:>7}  "
                     f"{str(f['request']):<{request_width}} {'+'.join(f['reasons']) or '-'}")
        if f["injected"]:
            inj = f["injected"]
            lines.append(f"{'':<4}injected at forward {inj[forward_key]} into {inj['request_id']}: {inj['detail']}")
    return lines
