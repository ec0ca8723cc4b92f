"""`kvcanary report FILE.jsonl [FILE ...]`: a summary of JSON-lines violation files, for after an incident.

Reads what every sink writes (`Violation.to_json`, one object per line: the runtime's ``jsonl_path``,
the transformers adapter's and each vLLM worker's, ``.rank<N>`` / ``{rank}`` files included) and
summarises them by reason (with what the reason usually means), launch tag, group, request, slot, step
and file, each with the first and last step it was seen at. ``--json PATH`` (``-`` for stdout) writes
the summary for programs; ``--png PATH`` draws violations per step, one colour per reason.

Steps count forwards of one canary: files from different ranks or processes have steps of their own,
so the per-file rows say which file a step range belongs to. Exit status 0 when the files hold no
violation, 1 when they hold some, 2 on unreadable input (a missing file, a line that is not JSON).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from typing import Iterable, Optional

from kvcanary.errors import KvCanaryValueError

TOP_DEFAULT = 10
# what to look at first, per reason family (docs/operations.md has the runbook)
FAMILY = {
    "verify_real_kv_hash": "bytes",
    "verify_chain_hash": "mapping",
    "verify_position": "mapping",
    "verify_token": "mapping",
    "verify_slot_out_of_range": "index",
    "write_slot_out_of_range": "index",
    "write_token": "write",
    "write_position": "write",
    "read_table_mismatch": "mapping",
    "verify_padding_slot_read": "mapping",
    "identity_adapter": "identity", "identity_salt": "identity", "identity_weights_version": "identity",
    "identity_context": "identity", "identity_multimodal": "identity", "identity_mismatch": "identity",
}
FAMILY_HINT = {
    "bytes": "K/V bytes changed in place: memory corruption, a copy/offload/transfer, or another request's write",
    "mapping": "a table maps a position to the wrong slot: stale block table, freed-while-used slot, wrong prefix hit",
    "index": "a slot index outside the KV pool: an uninitialised table entry or an allocator bug",
    "write": "the engine stored the wrong token or position: sampler/row mix-up or position bookkeeping",
    "identity": "KV produced under another identity (weights version, adapter, salt, image): a prefix-cache key "
    "that leaves it out",
}


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="summarise JSON-lines violation files (jsonl_path): by reason, request, slot, step",
                       description="Summarise one or more JSON-lines violation files written by kvcanary's sinks "
                                   "(jsonl_path; one file per rank for vLLM).")
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="violation files (Violation.to_json per line)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH ('-': stdout, no table)")
    p.add_argument("--png", metavar="PATH", help="draw violations per step, by reason (needs matplotlib)")
    p.add_argument("--top", type=int, default=TOP_DEFAULT, help=f"rows per table for requests, slots, steps (default {TOP_DEFAULT})")


def check_args(args) -> None:
    """Every argument, before any file is read."""
    from kvcanary.cli.main import check_output_path

    if args.top < 1:
        raise KvCanaryValueError(f"kv-canary: --top must be >= 1, got {args.top}")
    for path in args.files:
        if not os.path.isfile(path):
            raise KvCanaryValueError(f"kv-canary: report: {path!r} is not a file")
    if args.json not in (None, "-"):
        check_output_path("--json", args.json)
    check_output_path("--png", args.png)


def read_rows(paths: Iterable[str]) -> list[dict]:
    """Every violation object of ``paths``, each with ``_file`` (the path) and ``_line`` (1-based) added."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for n, text in enumerate(fh, 1):
                if not text.strip():
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise KvCanaryValueError(f"kv-canary: report: {path}:{n} is not JSON ({exc.msg})") from None
                if not isinstance(row, dict) or "launch_tag" not in row or "slot" not in row:
                    raise KvCanaryValueError(f"kv-canary: report: {path}:{n} is not a violation object "
                                             "(Violation.to_json: launch_tag, slot, fail_reason, ...)")
                row["_file"], row["_line"] = path, n
                rows.append(row)
    return rows


def _reasons(row: dict) -> list[str]:
    label = row.get("fail_reason")
    if label:
        return label.split("+")
    from kvcanary.runtime.reads import reason_labels

    return reason_labels(int(row.get("reasons", 0)))


def _meaning() -> dict[str, str]:
    from kvcanary.runtime.attribution import REASON_MEANING
    from kvcanary.runtime.reads import reason_label

    return {reason_label(int(bit)): text for bit, text in REASON_MEANING.items()}


class _Tally:
    """Count, first and last step, distinct slots / requests per key."""

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.first: dict = {}
        self.last: dict = {}
        self.slots: dict = defaultdict(set)
        self.requests: dict = defaultdict(set)
        self.reasons: dict = defaultdict(Counter)
        self.files: dict = defaultdict(set)

    def add(self, key, row: dict, reasons: list[str]) -> None:
        step = int(row.get("step", -1))
        self.count[key] += 1
        self.first[key] = min(self.first.get(key, step), step)
        self.last[key] = max(self.last.get(key, step), step)
        self.slots[key].add((row.get("group"), row.get("slot")))
        self.requests[key].add(row.get("request_id"))
        self.files[key].add(row["_file"])
        for r in reasons:
            self.reasons[key][r] += 1

    def rows(self, top: Optional[int] = None) -> list[dict]:
        out = []
        for key, n in self.count.most_common(top):
            out.append({"key": key, "violations": n, "first_step": self.first[key], "last_step": self.last[key],
                        "slots": len(self.slots[key]), "requests": len(self.requests[key] - {None}),
                        "files": len(self.files[key]),
                        "reasons": dict(self.reasons[key].most_common())})
        return out


def summarize(rows: list[dict], *, top: int = TOP_DEFAULT) -> dict:
    """The JSON-ready summary of violation ``rows`` (from `read_rows`)."""
    meaning = _meaning()
    by = {name: _Tally() for name in ("reason", "tag", "group", "request", "slot", "step", "file")}
    first = last = None
    for row in rows:
        reasons = _reasons(row)
        for r in reasons:
            by["reason"].add(r, row, [r])
        by["tag"].add(row["launch_tag"], row, reasons)
        by["group"].add(row.get("group"), row, reasons)
        by["request"].add("-" if row.get("request_id") is None else str(row["request_id"]), row, reasons)
        by["slot"].add(f"{row.get('group')}/{row['slot']}", row, reasons)
        by["step"].add(f"{row['_file']}@{row.get('step')}" if _many_files(rows) else row.get("step"), row, reasons)
        by["file"].add(row["_file"], row, reasons)
        key = (int(row.get("step", -1)), row["_file"], row["_line"])
        if first is None or key < first[0]:
            first = (key, row)
        if last is None or key > last[0]:
            last = (key, row)
    reason_rows = by["reason"].rows()
    for r in reason_rows:
        r["meaning"] = meaning.get(r["key"], "unknown reason")
        r["family"] = FAMILY.get(r["key"], "unknown")
    return {
        "violations": len(rows),
        "files": by["file"].rows(),
        "first": _public(first[1]) if first else None,
        "last": _public(last[1]) if last else None,
        "by_reason": reason_rows,
        "by_tag": by["tag"].rows(),
        "by_group": by["group"].rows(),
        "by_request": by["request"].rows(top),
        "requests": len(by["request"].count),
        "by_slot": by["slot"].rows(top),
        "slots": len(by["slot"].count),
        "by_step": by["step"].rows(top),
        "steps": len(by["step"].count),
        "per_step": _per_step(rows),
    }


def _many_files(rows: list[dict]) -> bool:
    return len({r["_file"] for r in rows}) > 1


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")} | {"file": row["_file"], "line": row["_line"]}


def _per_step(rows: list[dict]) -> dict[str, dict[str, int]]:
    """step -> reason -> violations (steps of every file together: the timeline's data)."""
    out: dict = defaultdict(Counter)
    for row in rows:
        for r in _reasons(row):
            out[str(row.get("step"))][r] += 1
    return {k: dict(v) for k, v in sorted(out.items(), key=lambda kv: int(kv[0]))}


def _table(title: str, header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """A left-aligned text table whose columns fit their longest cell (the last column is not padded)."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header) - 1)]
    lines = [title]
    for r in cells:
        lines.append("  " + "  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip())
    return lines


def _steps(r: dict) -> str:
    return str(r["first_step"]) if r["first_step"] == r["last_step"] else f"{r['first_step']}..{r['last_step']}"


def format_report(s: dict, *, top: int = TOP_DEFAULT) -> str:
    if not s["violations"]:
        return f"kvcanary report: no violations in {len(s['files']) or 'the'} file(s)"
    files = ", ".join(f"{f['key']} ({f['violations']}, steps {_steps(f)})" for f in s["files"])
    f = s["first"]
    lines = [f"kvcanary report: {s['violations']} violation(s), {s['requests']} request(s), {s['slots']} slot(s); "
             f"files: {files}",
             f"first seen: step {f.get('step')} {f['launch_tag']} {'+'.join(_reasons(f))} {f.get('group')} "
             f"slot {f['slot']} position {f.get('stored_position', '-')} "
             f"request {f['request_id'] if f.get('request_id') is not None else '-'} ({f['file']}:{f['line']})",
             f"last seen:  step {s['last']['step']} ({s['last']['file']}:{s['last']['line']})", ""]
    lines += _table("by reason", ("reason", "violations", "steps", "slots", "requests", "usually means"),
                    [(r["key"], r["violations"], _steps(r), r["slots"], r["requests"], r["meaning"])
                     for r in s["by_reason"]])
    families = sorted({r["family"] for r in s["by_reason"] if r["family"] in FAMILY_HINT})
    lines += ["", "what to look at (docs/operations.md, 'When it fires'):"]
    lines += [f"  {fam}: {FAMILY_HINT[fam]}" for fam in families]
    lines.append("")

    many = len(s["files"]) > 1  # steps count per file; slots and request ids may repeat across files (ranks)

    def tally(title: str, key: str, rows: list[dict], total: int) -> list[str]:
        more = f" (top {len(rows)} of {total})" if total > len(rows) else ""
        head = (key, "violations", "steps", "slots", "requests") + (("files",) if many else ()) + ("reasons",)
        return _table(title + more, head,
                      [(r["key"], r["violations"], _steps(r), r["slots"], r["requests"])
                       + ((r["files"],) if many else ()) + ("+".join(r["reasons"]),) for r in rows]) + [""]

    lines += tally("by launch tag", "tag", s["by_tag"], len(s["by_tag"]))
    lines += tally("by group", "group", s["by_group"], len(s["by_group"]))
    lines += tally("by request", "request", s["by_request"], s["requests"])
    lines += tally("by slot", "group/slot", s["by_slot"], s["slots"])
    more = f" (top {len(s['by_step'])} of {s['steps']})" if s["steps"] > len(s["by_step"]) else ""
    lines += _table("by step" + more, ("step", "violations", "slots", "requests", "reasons"),
                    [(r["key"], r["violations"], r["slots"], r["requests"], "+".join(r["reasons"]))
                     for r in s["by_step"]])
    return "\n".join(lines).rstrip()


def plot(summary: dict, path: str) -> Optional[str]:
    """Violations per step, stacked by reason; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    per_step = summary["per_step"]
    steps = [int(k) for k in per_step]
    reasons = sorted({r for v in per_step.values() for r in v})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bottom = [0] * len(steps)
    for reason in reasons:
        heights = [per_step[str(st)].get(reason, 0) for st in steps]
        ax.bar(steps, heights, bottom=bottom, label=reason, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("step (forward)")
    ax.set_ylabel("violations (per reason)")
    ax.set_title(f"kvcanary: {summary['violations']} violation(s) over {len(steps)} step(s)")
    if reasons:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(args) -> int:
    check_args(args)
    rows = read_rows(args.files)
    summary = summarize(rows, top=args.top)
    summary["files"] = summary["files"] or [{"key": p, "violations": 0} for p in args.files]
    if args.png:
        if plot(summary, args.png) is None:
            print("kv-canary: --png needs matplotlib (pip install 'kvcanary[plot]'); no chart written", file=sys.stderr)
    if args.json == "-":
        json.dump(summary, sys.stdout, indent=2, default=str)
        print()
    else:
        print(format_report(summary, top=args.top))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(summary, fh, indent=2, default=str)
            print(f"wrote {args.json}")
    if args.png and os.path.exists(args.png):
        print(f"wrote {args.png}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 1 if rows else 0
