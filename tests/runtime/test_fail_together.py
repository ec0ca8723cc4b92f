"""`runtime.fail_together`: two CPU processes (torch.multiprocessing, gloo) each drive a canary in ``raise`` mode
over their own KV; `raise_together` wraps each step. When rank 1's KV is corrupted both ranks raise in the same
step (rank 0 with no violation of its own); with no corruption neither raises; a rank whose step fails otherwise
makes the other raise too. Plus the single-process agreement and the device choice."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

from kvcanary.errors import KvCanaryRuntimeError, KvCanaryValueError  # noqa: E402
from kvcanary.runtime import CanaryViolationError  # noqa: E402
from kvcanary.runtime.fail_together import FailTogether, Verdict, raise_together  # noqa: E402

STEPS = 5
CORRUPT_BEFORE = 3  # rank 1's KV is damaged before the third forward, which reads it


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    """One rank: a canary (mode raise) over a hand-driven engine; every step inside `raise_together`. Writes what
    happened per step to ``out_dir/rank{rank}.json``."""
    from kvcanary.runtime import GroupSpec
    from tests.runtime.conftest import ManualEngine, make_canary

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        m = ManualEngine(make_canary([GroupSpec(name="full", num_slots=64, layer_ids=(0, 1))], max_requests=4,
                                     max_context=64, mode="raise"))
        together = FailTogether()  # the default group
        tokens, slots = list(range(100, 112)), list(range(10, 22))
        events = []
        for step in range(1, STEPS + 1):
            if step == 1:
                batch = m.batch(1, 0, tokens, slots)
            else:
                batch = m.batch(1, 12 + step - 2, [step], [30 + step])
            if step == CORRUPT_BEFORE and rank == 1:
                if scenario == "violation":
                    m.kv[0][0][slots[3], 0] ^= 1  # only rank 1's shard: the next forward's TAIL verify sees it
                elif scenario == "failure":
                    m.canary.stage = _broken  # rank 1's canary fails in this step (not a violation)
            try:
                raise_together(together, lambda: m.forward(batch), step=lambda: m.canary.step)
                events.append({"step": step, "raised": None})
            except CanaryViolationError as exc:
                events.append({"step": step, "raised": "violation", "at": exc.step, "own": len(exc.violations),
                               "elsewhere": exc.elsewhere, "first_line": str(exc).splitlines()[0]})
                break
            except KvCanaryRuntimeError as exc:
                events.append({"step": step, "raised": "failure", "message": str(exc)})
                break
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"events": events, "agreements": together.steps}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _broken(batch) -> None:
    raise RuntimeError("stage broke")


def _run(scenario: str, tmp_path: Path) -> list[dict]:
    mp.start_processes(_worker, args=(2, _port(), scenario, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_violation_on_one_rank_makes_every_rank_raise_in_that_step(tmp_path):
    r0, r1 = _run("violation", tmp_path)
    last0, last1 = r0["events"][-1], r1["events"][-1]
    assert last0["raised"] == last1["raised"] == "violation"
    assert last0["step"] == last1["step"] == last0["at"] == last1["at"] == CORRUPT_BEFORE
    assert last1["own"] >= 1 and last0["own"] == 0
    assert last0["elsewhere"] == last1["elsewhere"] == last1["own"]
    assert "the ranks of its group found" in last0["first_line"]
    assert all(e["raised"] is None for e in r0["events"][:-1] + r1["events"][:-1])
    assert r0["agreements"] == r1["agreements"] == CORRUPT_BEFORE


def test_no_violation_no_raise_on_any_rank(tmp_path):
    r0, r1 = _run("clean", tmp_path)
    for r in (r0, r1):
        assert [e["raised"] for e in r["events"]] == [None] * STEPS
        assert r["agreements"] == STEPS


def test_a_failing_rank_makes_the_other_raise_too(tmp_path):
    """Rank 1's canary fails in step 3 (raise mode re-raises it as a kv-canary error); rank 0 raises with it instead
    of waiting in the next collective."""
    r0, r1 = _run("failure", tmp_path)
    last0, last1 = r0["events"][-1], r1["events"][-1]
    assert last0["step"] == last1["step"] == CORRUPT_BEFORE
    assert last1["raised"] == "failure" and "stage broke" in last1["message"]
    assert last0["raised"] == "failure" and "1 rank(s) of the group failed in step 3" in last0["message"]


# ---------------------------------------------------------------------------------------- one process


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_agree_alone_and_raise_together_paths(world_of_one):
    together = FailTogether()
    assert together.device == torch.device("cpu")
    assert together.agree(3) == Verdict(violations=3, failed_ranks=0)
    assert together.agree(0, failed=True).any
    assert raise_together(together, lambda: "ok", step=1) == "ok"

    def violating():
        raise CanaryViolationError([], step=7, elsewhere=0)

    with pytest.raises(CanaryViolationError) as err:
        raise_together(together, violating, step=0)
    assert err.value.step == 7
    with pytest.raises(ZeroDivisionError):
        raise_together(together, lambda: 1 // 0, step=2)
    with pytest.raises(KvCanaryValueError, match="^kv-canary: FailTogether.agree violations must be an integer >= 0"):
        together.agree(-1)
    assert together.steps == 5
