"""The loop's batch inbox (services/engine/training_loop/inbox.py): a producer that found it
full is woken once the loop took it down to half, not at every batch (issue 28 item 3)."""

from __future__ import annotations

import threading
import time

import pytest

from services.engine.training_loop.inbox import Inbox

pytestmark = pytest.mark.timeout(30)


def _waiting(inbox: Inbox) -> int:
    """Producers waiting on the full inbox (a notify removes its waiter at once, under the lock)."""
    with inbox.mutex:
        return len(inbox.not_full._waiters)


def test_a_producer_blocked_on_a_full_inbox_is_woken_at_half_and_every_item_comes_out_once_in_order():
    inbox = Inbox(4)
    for i in range(4):
        inbox.put(i)
    producer = threading.Thread(target=lambda: [inbox.put(i) for i in range(4, 10)])
    producer.start()
    deadline = time.monotonic() + 10
    while _waiting(inbox) != 1:
        assert time.monotonic() < deadline, "the producer never waited on the full inbox"
        time.sleep(0.005)
    assert inbox.get() == 0
    assert _waiting(inbox) == 1  # 3 left of 4: not woken (a queue.Queue would have woken it)
    assert inbox.get() == 1
    assert _waiting(inbox) == 0  # 2 left: woken
    got = [inbox.get(timeout=10) for _ in range(8)]
    producer.join(10)
    assert got == list(range(2, 10)) and inbox.empty() and not producer.is_alive()


@pytest.mark.parametrize("size", [1, 2])
def test_a_small_inbox_wakes_its_producer_at_every_get_as_a_queue_does(size):
    inbox = Inbox(size)
    for i in range(size):
        inbox.put(i)
    producer = threading.Thread(target=inbox.put, args=(size,))
    producer.start()
    deadline = time.monotonic() + 10
    while _waiting(inbox) != 1:
        assert time.monotonic() < deadline, "the producer never waited on the full inbox"
        time.sleep(0.005)
    assert inbox.get() == 0
    assert _waiting(inbox) == 0
    producer.join(10)
    assert [inbox.get(timeout=10) for _ in range(size)] == list(range(1, size + 1))
