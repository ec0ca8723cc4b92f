"""`lookup.device_rows`: a step's request rows from the runtime's device history ``[H, max_rows]``
(row ``step % H``) while the step is among the last H kept, None otherwise (mutation audit)."""
import torch

from kvcanary.runtime.lookup import device_rows

H, MAX_ROWS = 4, 3  # H != MAX_ROWS: a shape mix-up shows


def _history():
    return torch.arange(H * MAX_ROWS, dtype=torch.int64).view(H, MAX_ROWS)


def test_kept_steps_read_their_row_of_the_ring():
    hist = _history()
    assert device_rows(hist, lambda: 10, 9) == hist[1].tolist()
    assert device_rows(hist, lambda: 10, 7) == hist[3].tolist()  # the oldest step still kept (10 - 7 < H)
    assert device_rows(hist, lambda: 2, 0) == hist[0].tolist()  # step 0 is a step like any other
    assert device_rows(hist, lambda: 1, 0) == [0, 1, 2]


def test_forgotten_and_negative_steps_give_none():
    hist = _history()
    assert device_rows(hist, lambda: 10, 6) is None  # 10 - 6 == H: overwritten by step 10's slot
    assert device_rows(hist, lambda: 10, 2) is None
    assert device_rows(hist, lambda: 0, -1) is None  # no step yet: nothing below 0, even inside the ring's reach
    assert device_rows(hist, lambda: 10, -1) is None


def test_request_of_a_row_from_the_step_log_or_the_device_history():
    from kvcanary.runtime.attribution import Attributor, StepEntry, StepLog

    log = StepLog(capacity=2)
    log.add(5, StepEntry(request_ids=("a", "b"), request_rows=(3, 1), forward_kind="decode"))
    log.add(6, StepEntry(request_ids=None, request_rows=None, forward_kind="prefill"))
    class Owners:  # the device history of request rows holds steps 6 and 9
        def rows_of_step(self, step):
            return [7, 2] if step in (6, 9) else None

    att = Attributor(log=log, owner_span=16, owners=Owners())
    assert att._request(5, 1) == ("b", 1)
    assert att._request(5, 2) == (None, None)  # past the step's rows
    assert att._request(6, 0) == (None, 7)  # no ids logged: rows from the device history
    assert att._request(9, 1) == (None, 2)  # step not in the log at all
    assert att._request(8, 0) == (None, None)
    log.add(7, StepEntry(request_ids=("c",), request_rows=(4,), forward_kind="decode"))  # step 5 forgotten
    assert att._request(5, 0) == (None, None) and log.forgotten == 1
    assert att._request(7, 0) == ("c", 4)  # the newest step is kept
    log.add(8, StepEntry(request_ids=("d",), request_rows=(5,), forward_kind="decode"))  # step 6 forgotten
    assert log.forgotten == 2 and att._request(7, 0) == ("c", 4) and att._request(8, 0) == ("d", 5)
