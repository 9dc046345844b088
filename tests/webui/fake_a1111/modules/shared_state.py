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
        self.current_image_sampling_step = 0
        self.id_live_preview = 0
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
        from modules import shared

        if shared.opts.live_previews_enable and shared.opts.show_progress_every_n_steps == -1:
            self.do_set_current_image()
        self.job_no += 1
        self.sampling_step = 0
        self.current_image_sampling_step = 0

    def set_current_image(self) -> None:
        """Called by the progress API (``/internal/progress``, ``/sdapi/v1/progress``) in its own thread:
        decodes ``current_latent`` if enough steps were made since the last preview."""
        from modules import shared

        if not shared.parallel_processing_allowed:
            return
        opts = shared.opts
        if (
            self.sampling_step - self.current_image_sampling_step >= opts.show_progress_every_n_steps
            and opts.live_previews_enable
            and opts.show_progress_every_n_steps != -1
        ):
            self.do_set_current_image()

    def do_set_current_image(self) -> None:
        if self.current_latent is None:
            return
        from modules import sd_samplers_common, shared

        if shared.opts.show_progress_grid:
            self.assign_current_image(sd_samplers_common.samples_to_image_grid(self.current_latent))
        else:
            self.assign_current_image(sd_samplers_common.sample_to_image(self.current_latent))
        self.current_image_sampling_step = self.sampling_step

    def assign_current_image(self, image: object) -> None:
        self.current_image = image
        self.id_live_preview += 1

    def begin(self, job: str = "(unknown)") -> None:
        self.job, self.job_no, self.interrupted, self.skipped = job, 0, False, False
        self.current_latent = self.current_image = None
        self.current_image_sampling_step = self.id_live_preview = 0
        self.stopping_generation = False

    def end(self) -> None:
        self.job = ""
        self.job_count = 0
