"""Fake ``modules.shared_state``: the job/progress/interrupt state."""

from __future__ import annotations


class State:
    """Mirrors A1111's ``State`` fields and methods used by extensions."""

    def __init__(self) -> None:
        self.job = ""
        self.job_count = 0
        self.job_no = 0
        self.sampling_step = 0
        self.sampling_steps = 0
        self.interrupted = False
        self.skipped = False
        self.stopping_generation = False
        self.textinfo: str | None = None
        self.current_latent = None
        self.current_image = None
        self.textinfo_history: list[str] = []

    def __setattr__(self, name: str, value: object) -> None:
        if name == "textinfo" and value:
            self.__dict__.setdefault("textinfo_history", []).append(str(value))
        super().__setattr__(name, value)

    def interrupt(self) -> None:
        self.interrupted = True

    def skip(self) -> None:
        self.skipped = True

    def nextjob(self) -> None:
        self.job_no += 1
        self.sampling_step = 0

    def begin(self, job: str = "(unknown)") -> None:
        self.job, self.job_no, self.interrupted, self.skipped = job, 0, False, False
        self.stopping_generation = False

    def end(self) -> None:
        self.job = ""
        self.job_count = 0
