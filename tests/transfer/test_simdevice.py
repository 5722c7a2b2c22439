"""The simulated device keeps CUDA's stream and event semantics (what the device data path relies on)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from aiokv import InvalidArgumentError, InvalidTypeError
from aiokv.transfer import SimulatedDevice, _simdevice
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
        ({"copy_bytes_per_s": 0}, InvalidArgumentError, r"copy_bytes_per_s must be a positive finite number"),
        ({"copy_bytes_per_s": -1e9}, InvalidArgumentError, r"copy_bytes_per_s must be a positive finite"),
        ({"copy_bytes_per_s": float("inf")}, InvalidArgumentError, r"positive finite number .*, got inf"),
        ({"copy_bytes_per_s": float("nan")}, InvalidArgumentError, r"positive finite number .*, got nan"),
        (
            {"copy_bytes_per_s": "25e9"},
            InvalidTypeError,
            r"copy_bytes_per_s must be a number or None, got str",
        ),
        (
            {"copy_bytes_per_s": True},
            InvalidTypeError,
            r"copy_bytes_per_s must be a number or None, got bool",
        ),
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


class FakeLink:
    """A deterministic clock for the modelled host link: time advances only when a stream's worker sleeps.
    Records each sleep: its length, the thread it ran on, and the device buffer's bytes at that moment."""

    def __init__(self, watch: torch.Tensor | None = None) -> None:
        self.now = 0.0
        self.watch = watch
        self.sleeps: list[tuple[float, str, torch.Tensor | None]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        snapshot = None if self.watch is None else self.watch.clone()
        self.sleeps.append((seconds, threading.current_thread().name, snapshot))
        self.now += seconds


@pytest.fixture
def link(monkeypatch: pytest.MonkeyPatch) -> FakeLink:
    fake = FakeLink()
    monkeypatch.setattr(_simdevice, "_clock", fake.clock)
    monkeypatch.setattr(_simdevice, "_sleep", fake.sleep)
    return fake


def test_host_link_copies_take_their_bytes_time_on_the_stream_before_completing(link: FakeLink) -> None:
    dev = SimulatedDevice(copy_bytes_per_s=1000.0)
    try:
        s = dev.new_stream("s")
        device_buf = dev.alloc(4000)
        device_buf.zero_()
        other = dev.alloc(1000)
        other.fill_(9)
        host = torch.arange(4000, dtype=torch.int32).to(torch.uint8)
        dev.pin(host)
        back = torch.zeros(2000, dtype=torch.uint8)
        dev.pin(back)
        link.watch = device_buf
        s.pause()
        dev.copy(s, device_buf[:1000], host[:1000])  # host -> device: 1 s on the link
        ev = dev.new_event()
        dev.record(ev, s)  # an event between copies does not interrupt the transfer
        dev.copy(s, device_buf[1000:], host[1000:])  # right behind it: 3 s more
        dev.copy(s, device_buf[:1000], other)  # device -> device: HBM speed, not modelled
        dev.copy(s, back, device_buf[2000:])  # device -> host: 2 s
        assert link.sleeps == []  # enqueued: nothing modelled before the stream runs it
        s.resume()
        dev.synchronize_stream(s)
        assert [d for d, _, _ in link.sleeps] == [1.0, 3.0, 2.0]
        assert {name for _, name, _ in link.sleeps} == {f"aiokv-sim-{s.name}"}
        # Each copy waits out its time before its bytes land.
        first, second, third = (snap for _, _, snap in link.sleeps)
        assert first is not None
        assert second is not None
        assert third is not None
        assert not torch.any(first)
        assert torch.equal(second[:1000], host[:1000])
        assert not torch.any(second[1000:])
        assert torch.all(third[:1000] == 9)
        assert torch.equal(third[1000:], host[1000:])
        assert torch.equal(back, host[2000:])
        assert dev.modelled_copy_s == 6.0
        assert dev.modelled_copy_bytes == 6000
        assert "copy_bytes_per_s=1000" in dev.describe()
    finally:
        dev.close()


def test_a_copy_after_a_wait_starts_when_the_stream_gets_to_it(link: FakeLink) -> None:
    """Back-to-back copies share the link's clock; a copy behind a wait or a kernel starts afresh (the time
    the stream spent waiting is not credited to it)."""
    dev = SimulatedDevice(copy_bytes_per_s=100.0)
    try:
        s, other = dev.new_stream("s"), dev.new_stream("other")
        device_buf = dev.alloc(300)
        host = torch.ones(300, dtype=torch.uint8)
        dev.pin(host)
        gate = other.hold()
        ev = dev.new_event()
        dev.record(ev, other)
        s.pause()
        dev.copy(s, device_buf[:100], host[:100])
        dev.wait_event(s, ev)
        dev.copy(s, device_buf[100:200], host[100:200])
        dev.launch(s, lambda: None)
        dev.copy(s, device_buf[200:], host[200:])
        s.resume()
        dev.wait_quiescent()
        assert [d for d, _, _ in link.sleeps] == [1.0]
        link.now += 5.0  # the wait lasts 5 s
        gate.set()
        dev.synchronize_stream(s)
        assert [d for d, _, _ in link.sleeps] == [1.0, 1.0, 1.0]
        assert link.now == 8.0
        assert dev.modelled_copy_s == 3.0
    finally:
        dev.close()


def test_without_a_link_bandwidth_copies_are_not_delayed(link: FakeLink) -> None:
    dev = SimulatedDevice()
    try:
        s = dev.new_stream("s")
        device_buf = dev.alloc(64)
        host = torch.arange(64, dtype=torch.uint8)
        dev.pin(host)
        dev.copy(s, device_buf, host)
        dev.synchronize_stream(s)
        assert torch.equal(device_buf, host)
        assert link.sleeps == []
        assert dev.copy_bytes_per_s is None
        assert dev.modelled_copy_s == 0.0
        assert dev.modelled_copy_bytes == 0
    finally:
        dev.close()
