"""Weak-reference callbacks that never wait for a lock.

A weak reference's callback runs wherever the garbage collector does: on any thread, in the middle of any
code, and at the interpreter's exit, after its daemon threads were frozen where they stood, perhaps holding
the very lock the callback wants. The batch command hung so at its exit (2026-11-28): the weight file's page
keeper, a daemon thread, was frozen holding the file's lock, and the exit's last collection called a callback
that waited for it. :class:`ForgetLater` runs a callback's removal under the lock when the lock is free, and
otherwise leaves it to the lock's next holder.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any


class ForgetLater:
    """Removals asked for by weak-reference callbacks, for the registry guarded by ``lock``.

    Args:
        lock: the registry's lock (a ``threading.Lock`` or ``RLock``).
    """

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._pending: collections.deque[Callable[[], None]] = collections.deque()

    def __call__(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` now if the lock can be taken without waiting, else when its next holder calls
        :meth:`drain`. ``remove`` must be harmless when run late (compare the weak reference it was made for)."""
        if self._lock.acquire(blocking=False):
            try:
                self.drain()
                remove()
            finally:
                self._lock.release()
        else:
            self._pending.append(remove)  # (a deque's append and popleft are atomic)

    def drain(self) -> None:
        """Run the removals left for the lock's holder; call with the lock held."""
        while True:
            try:
                remove = self._pending.popleft()
            except IndexError:
                return
            remove()

    def __len__(self) -> int:
        return len(self._pending)
