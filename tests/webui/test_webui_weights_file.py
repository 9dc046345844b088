"""Settings -> OpenVINO -> "Keep PyTorch's copy of the accelerated weights in a file on disk" (default on): the routed
parts' weights move into the backend's weight file at their first compile, and the status says so; turned
off, they stay in memory and no file is made. Either way the picture is the same."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff

from ov_accelerate_webui.options import WEIGHTS_IN_FILE_OPTION


def files_of(extension: Any) -> tuple[int, int | None]:
    return extension.accelerator().backends.weights_in_files()


def test_on_by_default_the_weights_move_and_the_status_says_so(fake_host: SimpleNamespace, extension: Any,
                                                                f32: Any) -> None:
    unet = fake_host.shared.sd_model.model.diffusion_model
    params = list(unet.parameters())
    plain = fake_host.processing.process_images(make_p(fake_host))
    processed = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(plain, processed) <= IMAGE_TOLERANCE
    size, resident = files_of(extension)
    assert size >= sum(p.numel() * p.element_size() for p in params) and resident == 0
    assert all(a is b for a, b in zip(unet.parameters(), params))  # the same tensors, now reading the file
    assert "in a memory-mapped file, 0 B of it in memory after the generation" in extension.last_status
    again = fake_host.processing.process_images(make_p(fake_host))  # stock reads them from the file
    assert max_pixel_diff(plain, again) == 0


def test_turned_off_nothing_moves(fake_host: SimpleNamespace, extension: Any, f32: Any) -> None:
    setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, False)
    try:
        plain = fake_host.processing.process_images(make_p(fake_host))
        processed = extension.run(make_p(fake_host), f32)
    finally:
        setattr(fake_host.shared.opts, WEIGHTS_IN_FILE_OPTION, True)
    assert max_pixel_diff(plain, processed) <= IMAGE_TOLERANCE
    assert files_of(extension) == (0, 0)
    assert "memory-mapped file" not in extension.last_status


def test_between_generations_openvino_holds_no_intermediate_memory(fake_host: SimpleNamespace, extension: Any,
                                                                    f32: Any) -> None:
    """At the end of a generation the compiled models give back their inference requests' intermediate tensors
    (a VAE at 1024x1024 f32: 3 GiB); the next generation allocates them again and makes the same picture."""
    from ov_backend import runtime

    first = extension.run(make_p(fake_host), f32)
    runners = list(runtime._RUNNERS)
    assert runners and not any(r._holds_memory for r in runners)
    again = extension.run(make_p(fake_host), f32)
    assert max_pixel_diff(first, again) == 0
    assert not any(r._holds_memory for r in runtime._RUNNERS)
