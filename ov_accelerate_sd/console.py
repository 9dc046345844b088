"""What the commands print and how they stop: the user's lines on stdout and stderr, exit codes, Ctrl-C.

A module of its own so that ``cli`` (the arguments), the commands and the worker processes all print the same way
without importing one another.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

logger = logging.getLogger(__name__)

#: The exit code after Ctrl-C (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPTED = 130


def out(text: str) -> None:
    """A line for the user on stdout, flushed (a run's progress reads as it happens)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    """A warning or an error on stderr, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class StopRequest:
    """SIGINT handler: the first Ctrl-C asks to stop after the current step, the second aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        err("\nstopping after the current step (Ctrl-C again to abort)")

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)
