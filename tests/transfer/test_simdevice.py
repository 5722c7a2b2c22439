"""The simulated device keeps CUDA's stream and event semantics (what the device data path relies on)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from aiokv import InvalidArgumentError, InvalidTypeError
from aiokv.transfer import SimulatedDevice
from aiokv.transfer._simdevice import SimulatedDeviceError


@pytest.fixture
def dev() -> SimulatedDevice:
    d = SimulatedDevice(seed=3, jitter_s=0.0005)
    yield d
    d.close()


def test_work_runs_later_in_order_on_the_streams_worker(dev: SimulatedDevice) -> None:
    s = dev.new_stream("s")
    s.pause()
    ran: list[tuple[int, str]] = []
    for i in range(5):
        dev.launch(s, lambda i=i: ran.append((i, threading.current_thread().name)))
    assert ran == []  # enqueued, not run: the call returned first
    assert s.pending == 5
    s.resume()
    dev.synchronize_stream(s)
    assert [i for i, _ in ran] == [0, 1, 2, 3, 4]
    assert {name for _, name in ran} == {f"aiokv-sim-{s.name}"}


def test_an_event_marks_a_point_and_a_wait_orders_another_stream_after_it(dev: SimulatedDevice) -> None:
    a, b = dev.new_stream("a"), dev.new_stream("b")
    a.pause()
    order: list[str] = []
    dev.launch(a, lambda: order.append("a1"))
    ev = dev.new_event()
    dev.record(ev, a)
    dev.launch(a, lambda: order.append("a2"))  # after the point: b does not wait for it
    assert not dev.query(ev)
    dev.wait_event(b, ev)
    dev.launch(b, lambda: order.append("b1"))
    dev.wait_quiescent()
    assert order == []  # b waits on the device, the host is not blocked
    assert b.blocked_on_event
    a.resume()
    dev.synchronize_stream(b)
    dev.synchronize_stream(a)
    assert order.index("a1") < order.index("b1")
    assert dev.query(ev)


def test_waiting_on_an_event_never_recorded_does_nothing(dev: SimulatedDevice) -> None:
    """As in CUDA: the classic way to wait on work that was never submitted."""
    b = dev.new_stream("b")
    ev = dev.new_event()
    assert dev.query(ev)
    dev.wait_event(b, ev)
    ran: list[int] = []
    dev.launch(b, lambda: ran.append(1))
    dev.synchronize_stream(b)
    assert ran == [1]
    dev.synchronize(ev)  # returns at once


def test_recording_again_moves_the_point_for_later_waits_only(dev: SimulatedDevice) -> None:
    a, b = dev.new_stream("a"), dev.new_stream("b")
    ev = dev.new_event()
    dev.record(ev, a)
    dev.synchronize(ev)
    dev.wait_event(b, ev)  # waits for the first recording: already reached
    a.pause()
    dev.launch(a, lambda: None)
    dev.record(ev, a)  # a new point, not reached while a is paused
    ran: list[int] = []
    dev.launch(b, lambda: ran.append(1))
    dev.synchronize_stream(b)
    assert ran == [1]
    assert not dev.query(ev)
    a.resume()
    dev.synchronize(ev)


def test_an_execution_error_surfaces_at_synchronize_and_breaks_the_stream(dev: SimulatedDevice) -> None:
    s = dev.new_stream("s")
    dev.fail_next("kernel", after=1)
    ran: list[int] = []
    dev.launch(s, lambda: ran.append(0))
    dev.launch(s, lambda: ran.append(1))  # this one fails
    dev.launch(s, lambda: ran.append(2))  # a broken stream runs nothing more
    ev = dev.new_event()
    dev.record(ev, s)
    with pytest.raises(SimulatedDeviceError, match="injected kernel failure"):
        dev.synchronize(ev)
    assert ran == [0]
    assert s.error is not None


def test_an_enqueue_failure_raises_at_once(dev: SimulatedDevice) -> None:
    s = dev.new_stream("s")
    dev.fail_next_enqueue(after=1)
    dev.launch(s, lambda: None)
    with pytest.raises(SimulatedDeviceError, match="injected failure enqueuing a kernel"):
        dev.launch(s, lambda: None)
    dev.launch(s, lambda: None)  # only one call fails
    dev.synchronize_stream(s)


def test_copies_need_pinned_host_memory(dev: SimulatedDevice) -> None:
    s = dev.new_stream("s")
    device_buf = dev.alloc(64)
    host = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="host memory of an asynchronous copy must be pinned"):
        dev.copy(s, device_buf, host)
    dev.pin(host)
    assert dev.is_pinned(host)
    assert dev.is_pinned(host[8:16])
    dev.copy(s, device_buf, host)
    dev.synchronize_stream(s)
    assert torch.equal(device_buf, host)
    dev.unpin(host)
    assert not dev.is_pinned(host)


def test_capture_is_reported_per_stream(dev: SimulatedDevice) -> None:
    s, t = dev.new_stream("s"), dev.new_stream("t")
    with dev.capturing(s):
        assert dev.is_capturing(s)
        assert not dev.is_capturing(t)
    assert not dev.is_capturing(s)


def test_current_stream_is_per_thread(dev: SimulatedDevice) -> None:
    s = dev.new_stream("s")
    assert dev.current_stream() is dev.default_stream
    seen: list[object] = []
    with dev.stream(s):
        assert dev.current_stream() is s
        t = threading.Thread(target=lambda: seen.append(dev.current_stream()))
        t.start()
        t.join()
    assert seen == [dev.default_stream]
    assert dev.current_stream() is dev.default_stream


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"delay_s": -1.0}, InvalidArgumentError, r"delay_s must be >= 0, got -1.0"),
        ({"jitter_s": float("nan")}, InvalidArgumentError, r"jitter_s must be >= 0, got nan"),
        ({"delay_s": "1"}, InvalidTypeError, r"delay_s must be a number, got str"),
        ({"seed": 1.5}, InvalidTypeError, r"seed must be an int, got float"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SimulatedDevice(**kwargs)  # type: ignore[arg-type]


def test_close_runs_queued_work_and_refuses_more() -> None:
    dev = SimulatedDevice()
    s = dev.new_stream("s")
    s.pause()
    ran: list[int] = []
    dev.launch(s, lambda: ran.append(1))
    dev.close()
    assert ran == [1]
    with pytest.raises(SimulatedDeviceError, match="closed"):
        dev.launch(s, lambda: None)
    dev.close()  # idempotent


def test_a_finalizer_running_under_the_device_lock_does_not_deadlock() -> None:
    """Regression: device memory is untracked by a weakref finalizer, which the garbage collector may run on
    a thread that holds the device's lock (it did, inside ``new_stream``): the lock must be re-entrant."""
    sim = SimulatedDevice()
    before = sim.allocated_bytes
    buf: torch.Tensor | None = sim.alloc(4096)
    assert sim.allocated_bytes == before + 4096

    def collect_under_the_lock() -> None:
        nonlocal buf
        with sim._lock:
            buf = None
            gc.collect()  # the finalizer runs here, on this thread

    t = threading.Thread(target=collect_under_the_lock, daemon=True)
    t.start()
    t.join(timeout=30)  # a hang guard: with a plain lock the thread never ends
    assert not t.is_alive()  # (a deadlocked device is left unclosed: closing it would hang too)
    assert sim.allocated_bytes == before
    sim.close()
