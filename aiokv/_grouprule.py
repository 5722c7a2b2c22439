"""The rules of grouped layouts that need no tensors: which blocks a boundary needs, which prefix is restorable,
which window and state parts are worth storing. Pure and torch-free: the offloader (:mod:`aiokv._groups`)
and the replay simulator (:mod:`aiokv.replay`) both follow them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Retention", "longest_hit", "window_blocks"]


def window_blocks(window: int, block_size: int) -> int:
    """Blocks a boundary needs from a sliding-window group of ``window`` tokens: those holding the last
    ``window - 1`` tokens before it (the next token attends to them and to itself)."""
    return -(-(window - 1) // block_size)


def longest_hit(
    n: int,
    base: Sequence[bool] | None,
    windows: Sequence[tuple[int, Sequence[bool]]] = (),
    states: Sequence[Sequence[bool]] = (),
) -> int:
    """The longest prefix of ``N <= n`` blocks restorable under the group rule (a pure reference the
    offloader's lookup and the replay simulator follow).

    ``base[i]``: block ``i``'s base part is present (``None``: the layout has no full or latent group).
    ``windows``: per sliding-window part, ``(w, present)`` with ``w`` its :func:`window_blocks` and
    ``present[i]`` whether block ``i``'s window part is present. ``states``: per state part, ``present[i]``
    whether the snapshot after block ``i`` (at boundary ``i + 1``) is present. Returns the largest ``N`` such
    that base blocks ``[0, N)``, window blocks ``[max(0, N - w), N)`` of every window part and the snapshot at
    ``N`` of every state part are present; ``0`` if none (``N = 0`` needs nothing).
    """
    top = n
    if base is not None:
        top = 0
        while top < n and base[top]:
            top += 1
    N = top
    while N > 0:
        if any(not present[N - 1] for present in states):
            N -= 1
            continue
        bad = -1  # the latest missing window block before N
        for w, present in windows:
            for j in range(N - 1, max(0, N - w) - 1, -1):
                if not present[j]:
                    bad = max(bad, j)
                    break
        if bad < 0:
            return N
        N = bad  # every N' with N' - w <= bad < N' needs it: the next candidate is bad itself
    return 0


@dataclass(frozen=True, slots=True)
class Retention:
    """Which window and state parts are worth storing: those some kept boundary can use.

    Kept boundaries (in blocks): every multiple of ``checkpoint`` blocks, the prompt's end (its last full
    block), and the request's final boundary (its full blocks when it finishes or is preempted). A window part
    of block ``j`` is kept when a kept boundary ``N`` has ``N - w <= j < N``; a state snapshot at ``N`` when
    ``N`` is kept. Everything else is never stored: no hit under :func:`longest_hit` could use it.
    """

    checkpoint: int  # blocks between checkpoints (> 0)

    def keep_window_at_fill(self, j: int, w: int, prompt_blocks: int) -> bool:
        """Store block ``j``'s window part when it fills: a checkpoint or the prompt end needs it."""
        if j < prompt_blocks <= j + w:
            return True
        c = self.checkpoint
        nxt = (j // c + 1) * c  # the first checkpoint after block j
        return nxt <= j + w

    def keep_state_at_fill(self, boundary: int, prompt_blocks: int) -> bool:
        return boundary == prompt_blocks or boundary % self.checkpoint == 0
