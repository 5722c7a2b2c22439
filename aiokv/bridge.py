"""Using aiokv from threads that are not the offloader's event loop.

- :class:`ThreadBridge` / :class:`ThreadRequest`: every operation of :class:`aiokv.Request` (and
  :meth:`aiokv.Offloader.open`) from a synchronous scheduler thread, answered through
  :class:`concurrent.futures.Future` in the order the thread made the calls (see :mod:`aiokv._bridge`'s
  module documentation and docs/guide.md, "Threads"). :meth:`ThreadRequest.load` returns a
  :class:`ThreadLoad`: the whole load's future, with ``layer(i)`` for a layer-wise load's layers.
- :func:`call_in_loop`: the one path from a thread to the loop, for code that needs something else run there
  (the vLLM connector and the Prometheus collector use it). It refuses the loop's own thread, fails the future
  with :class:`aiokv.ClosedError` once the loop is closed, and does nothing if the future was cancelled first.
"""

from ._bridge import ThreadBridge, ThreadLoad, ThreadRequest, call_in_loop

__all__ = ["ThreadBridge", "ThreadLoad", "ThreadRequest", "call_in_loop"]
