"""The command line end to end: generate (demo, prompts file, batch, img2img), devices, cache, Ctrl-C, errors."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ov_accelerate_sd.cli import build_parser, main, parse_size
from ov_accelerate_sd.pnginfo import parse_infotext, read_png_infotext
from ov_accelerate_sd.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--width", "64", "--height", "64", "--steps", "2"]
PYTORCH_ONLY = ["--pytorch", "unet", "--pytorch", "vae", "--pytorch", "text_encoder"]


def _run(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "ov_backend", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--demo", "--width", "100"], "100 must be a multiple of 8"),
        (["generate", "--demo", "--sampler", "Euler b"], "unknown sampler 'Euler b'; valid samplers:"),
        (["generate", "--checkpoint", "/no/such.safetensors", "--prompt", "x"], "no such file"),
        (["generate", "--demo", "--device", "NOPE"], "NOPE"),
        (["generate", "--demo", "--precision", "fp8"], "invalid choice: 'fp8'"),
        (["generate", "--demo", "--denoising-strength", "1.5"], "must be in (0, 1]"),
        (["generate", "--demo", "--batch-size", "0"], "must be at least 1"),
        (["generate", "--demo", "--cfg-scale", "-1"], "argument --cfg-scale: -1 must be a finite number >= 0"),
        (["generate", "--demo", "--cfg-scale", "nan"], "argument --cfg-scale: nan must be a finite number >= 0"),
        (["generate", "--demo", "--cfg-scale", "inf"], "argument --cfg-scale: inf must be a finite number >= 0"),
        (["generate", "--demo", "--cfg-scale", "x"], "argument --cfg-scale: 'x' is not a number"),
        (["generate", "--prompt", "x"], "one of the arguments --checkpoint --demo is required"),
        (["generate", "--demo", "--init-image", "/no/such.png"], "cannot read the image"),
        (["cache", "prune"], "needs --max-size"),
        (["cache", "list", "--max-size", "2G"], "only applies to 'cache prune'"),
        (["cache", "prune", "--max-size", "lots"], "is not a size"),
        (["generate", "--demo", "--cache-max-size", "lots"], "argument --cache-max-size: 'lots' is not a size"),
        (["cache", "clear", "nosuchkey"], "no cache entries named nosuchkey"),
        (["demo", "--device", "NOPE"], "NOPE"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list, message: str, capsys, tmp_path: Path) -> None:
    extra = {"generate": ["--out", str(tmp_path / "o")], "cache": ["--cache-dir", str(tmp_path / "c")]}
    err = _usage_error(argv + extra.get(argv[0], []), capsys)
    assert message in err
    # The usage line is the sub-command's, not the top-level one.
    usage = next(line for line in err.splitlines() if line.startswith("usage:"))
    assert usage.startswith(f"usage: python -m ov_backend {argv[0]}" if argv[0] != "frobnicate"
                            else "usage: python -m ov_backend [-h]"), usage
    assert not (tmp_path / "o").exists()


def test_bad_checkpoint_is_a_usage_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 16)
    err = _usage_error(["generate", "--checkpoint", str(bad), "--prompt", "x", *SMALL, "--out",
                        str(tmp_path / "o"), *PYTORCH_ONLY], capsys)
    assert str(bad) in err and "not a safetensors file" in err
    assert "usage: python -m ov_backend generate" in err
    assert not (tmp_path / "o").exists()  # the output folder is made only once the model has loaded


def test_parse_size() -> None:
    assert parse_size("2G") == 2 << 30 and parse_size("500M") == 500 << 20 and parse_size("1024") == 1024


def test_prompts_file_batches_and_img2img(tmp_path: Path, sd1_checkpoint: Path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\nlong (prompt:1.2) " + "word " * 90 + "\n", encoding="utf-8")
    out = tmp_path / "out"
    code = main(["generate", "--checkpoint", str(sd1_checkpoint), "--prompts-file", str(prompts),
                 "--negative-prompt", "blurry", "--batch-size", "2", "--batch-count", "2", "--seed", "5",
                 "--sampler", "DPM++ 2M Karras", *SMALL, "--out", str(out), *PYTORCH_ONLY])
    assert code == 0
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files][:4] == ["00000-5.png", "00001-6.png", "00002-7.png", "00003-8.png"]
    assert len(files) == 8
    info = parse_infotext(read_png_infotext(files[4]))
    assert info["Prompt"].startswith("long (prompt:1.2) word")
    assert info["Negative prompt"] == "blurry" and info["Seed"] == "5"
    assert info["Sampler"] == "DPM++ 2M" and info["Schedule type"] == "Karras" and info["Size"] == "64x64"
    assert info["Model"] == sd1_checkpoint.stem and len(info["Model hash"]) == 10
    assert "OpenVINO" not in info  # made in PyTorch
    summary = capsys.readouterr().out.splitlines()[-1]
    # 4 batches: the first is the warm-up, the 3 after it give seconds per image; 1 interval per batch gives s/it.
    assert summary.startswith(f"8 image(s) in {out}: load ")
    assert "first batch " in summary and " s/it" in summary and "s per image after the first batch" in summary

    code = main(["generate", "--checkpoint", str(sd1_checkpoint), "--prompt", "x", "--init-image", str(files[0]),
                 "--denoising-strength", "0.5", "--seed", "1", *SMALL, "--out", str(out), *PYTORCH_ONLY])
    assert code == 0
    made = out / "00008-1.png"
    assert parse_infotext(read_png_infotext(made))["Denoising strength"] == "0.5"


def test_demo_through_openvino_then_cache_commands(tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    proc = _run("generate", "--demo", "--prompt", "a cat", *SMALL, "--seed", "3", "--precision", "f32",
                "--cache-dir", str(cache), "--out", str(out))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    summary = stdout.splitlines()[-1]
    assert summary.startswith(f"1 image(s) in {out}: load "), stdout
    assert "first batch" in summary and "OpenVINO compile" in summary and " s/it" in summary
    assert "per image" not in summary  # one batch only: nothing after the warm-up to measure it on
    assert "OpenVINO calls" in summary
    assert "3 captured and saved for the next run" in summary, summary  # UNet, VAE decoder, text encoder
    info = parse_infotext(read_png_infotext(out / "00000-3.png"))
    assert info["OpenVINO"] == "CPU, UNet+VAE+TE, f32"  # the WebUI's entry: the image pastes back into its panel

    # a second run loads dynamo's captures from the cache instead of tracing again, and makes the same image
    proc = _run("generate", "--demo", "--prompt", "a cat", *SMALL, "--seed", "3", "--precision", "f32",
                "--cache-dir", str(cache), "--out", str(tmp_path / "again"))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    summary = stdout.splitlines()[-1]
    assert "3 loaded from the cache" in summary and "captured" not in summary, summary
    first, again = (np.asarray(Image.open(folder / "00000-3.png")) for folder in (out, tmp_path / "again"))
    assert np.array_equal(first, again)

    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    listed = capsys.readouterr().out
    assert "entries" in listed and not listed.startswith("0 entries")
    key = listed.split()[0]
    err = _usage_error(["cache", "clear", key, "nosuchkey", "--cache-dir", str(cache)], capsys)
    assert "no cache entries named nosuchkey" in err and "nothing was removed" in err and key not in err
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out == listed
    assert main(["cache", "prune", "--max-size", "0", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.startswith("removed")
    assert main(["cache", "clear", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.startswith("removed")
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.startswith("0 entries")


def test_devices_lists_cpu(capsys) -> None:
    assert main(["devices"]) == 0
    assert capsys.readouterr().out.startswith("CPU")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_stops_after_the_current_step_and_keeps_saved_images(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _run("generate", "--demo", "--prompt", "a cat", "--width", "64", "--height", "64", "--steps", "30",
                "--batch-count", "6", "--seed", "1", *PYTORCH_ONLY, "--out", str(out))
    for line in proc.stdout:
        if line.startswith("[1/6]"):
            proc.send_signal(signal.SIGINT)
            break
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "stopped by Ctrl-C" in stderr
    saved = sorted(p.name for p in out.iterdir())
    assert saved[0] == "00000-1.png" and 1 <= len(saved) < 6
    assert all(name.endswith(".png") for name in saved)  # nothing half-written


def test_every_option_has_help_text() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {action.option_strings or action.dest}"
               for name, sub in commands.choices.items() for action in sub._actions
               if not action.help and not isinstance(action, argparse._HelpAction) and action.dest != "action"]
    assert missing == []


def _imports(argv: list[str], cwd: Path) -> tuple[int, str, set[str]]:
    """Exit code, output and the modules a ``python -m ov_backend`` process imported (``-X importtime``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ov_backend", *argv], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    output = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("import time:"))
    return done.returncode, output, modules


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["generate", "--help"], 0),
        (["cache", "--help"], 0),
        (["demo", "--help"], 0),
        (["frobnicate"], 2),
        (["generate", "--prompt", "x"], 2),
        (["generate", "--demo", "--cfg-scale", "nan"], 2),
        (["generate", "--demo", "--width", "100"], 2),
        (["generate", "--demo", "--prompt", "x", "--out", "blocker/o"], 2),
        (["generate", "--checkpoint", "missing.safetensors", "--prompt", "x"], 2),
    ],
)
def test_help_and_argument_errors_load_neither_torch_nor_openvino(argv: list, code: int, tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file, not a folder")
    returncode, output, modules = _imports(argv, tmp_path)
    assert returncode == code, output
    assert "ov_accelerate_sd.cli" in modules  # the import list is read correctly
    assert not modules & {"torch", "openvino", "diffusers"}, output


def test_a_command_that_needs_openvino_loads_it(tmp_path: Path) -> None:
    # The counterpart of the test above: the same import list does show OpenVINO when it loads.
    returncode, output, modules = _imports(["devices"], tmp_path)
    assert returncode == 0, output
    assert "openvino" in modules


@pytest.mark.parametrize("verbose", [[], ["-v"]], ids=["quiet", "verbose"])
@pytest.mark.parametrize("command", ["devices", "cache", "demo", "generate"])
def test_every_sub_command_runs_with_and_without_verbose(command: str, verbose: list, tmp_path: Path,
                                                         sd1_checkpoint: Path, capsys) -> None:
    argv = {
        "devices": ["devices"],
        "cache": ["cache", "list", "--cache-dir", str(tmp_path / "cache")],
        "demo": ["demo"],
        "generate": ["generate", "--checkpoint", str(sd1_checkpoint), "--prompt", "x", "--seed", "2", *SMALL,
                     "--out", str(tmp_path / "out"), *PYTORCH_ONLY],
    }[command]
    assert main([*verbose, *argv]) == 0
    out = capsys.readouterr().out
    if command == "devices":
        assert out.startswith("CPU")
    elif command == "cache":
        assert out.startswith("0 entries")
    elif command == "demo":
        diffs = [float(d) for d in re.findall(r"max \|OpenVINO - PyTorch\| = (\S+)", out)]
        assert len(diffs) == 3 and max(diffs) < 1e-4, out
        assert ("partition" in out.lower()) == bool(verbose), out  # -v adds the compile reports
    else:
        assert (tmp_path / "out" / "00000-2.png").is_file()


def test_out_folder_that_cannot_be_created_is_refused_before_rendering(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file")
    err = _usage_error(["generate", "--demo", "--prompt", "x", "--out", str(blocker / "sub" / "o")], capsys)
    assert f"--out {blocker / 'sub' / 'o'}: cannot be created: {blocker} is not a folder" in err
    err = _usage_error(["generate", "--demo", "--prompt", "x", "--out", str(blocker)], capsys)
    assert f"--out {blocker}: {blocker} is not a folder" in err
    assert "usage: python -m ov_backend generate" in err


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root may write into a read-only folder")
def test_out_folder_that_is_not_writable_is_refused_before_rendering(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    err = _usage_error(["generate", "--demo", "--prompt", "x", "--out", str(folder)], capsys)
    assert f"--out {folder}: {folder} is not writable" in err
    err = _usage_error(["generate", "--demo", "--prompt", "x", "--out", str(folder / "new")], capsys)
    assert f"cannot be created: {folder} is not writable" in err


def test_a_png_that_cannot_be_saved_is_reported_and_the_run_goes_on(tmp_path: Path, sd1_checkpoint: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = Path.write_bytes

    def write_bytes(path: Path, data: bytes) -> int:  # the disk is full while the second PNG is written
        if "00001-" in path.name:
            real_write(path, data[: len(data) // 2])  # (part of it reached the disk)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_write(path, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)
    out = tmp_path / "out"
    code = main(["generate", "--checkpoint", str(sd1_checkpoint), "--prompt", "x", "--seed", "4", "--batch-count",
                 "3", *SMALL, "--out", str(out), *PYTORCH_ONLY])
    assert code == 1
    captured = capsys.readouterr()
    assert f"error: could not save {out / '00001-5.png'}: {os.strerror(errno.ENOSPC)}" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["00000-4.png", "00002-6.png"]  # no temporary file left
    assert f"2 image(s) in {out}" in captured.out


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("width", [32, 100])
def test_every_entry_refuses_a_size_by_the_same_rule(width: int, tmp_path: Path, capsys) -> None:
    """The command line, a job file's line and the library answer a width the same way: a multiple of 8 and at least
    64 (the library alone accepted 8 to 56)."""
    from ov_accelerate_sd.pipeline import GenerationJob

    rule = f"{width} must be a multiple of 8 and at least 64"
    assert f"argument --width: {rule}" in _usage_error(["generate", "--demo", "--width", str(width)], capsys)
    assert f"argument --width: {rule}" in _usage_error(
        ["batch", "--prompts-file", str(tmp_path / "p.txt"), "--width", str(width), "--out", str(tmp_path)], capsys)
    jobs = tmp_path / "j.jsonl"
    jobs.write_text(f'{{"prompt": "x", "width": {width}}}\n')
    assert f"{jobs}:1: width {rule}" in _usage_error(["batch", str(jobs), "--out", str(tmp_path / "o")], capsys)
    with pytest.raises(ValueError, match=f"^width {rule}"):
        GenerationJob("x", width=width).validated()


def test_run_times_keep_the_first_batch_and_the_dropped_batch_apart() -> None:
    clock = FakeClock()
    times = Progress(clock=clock)

    def batch(step_ends: list[float], end: float, kept: int | None) -> None:
        times.batch_started()
        for t in step_ends:
            clock.now = t
            times.step()
        clock.now = end
        times.batch_done(kept) if kept is not None else times.batch_dropped()

    # First batch: 6 s until its first step (capture + compile), then 0.5 s steps, 1 s decode (first VAE call).
    batch([106.0, 106.5, 107.0], 108.0, kept=2)
    # Steady batches of 2 images: 0.2 s before the first step, 0.5 s steps, 0.3 s decode -> 1.5 s, 0.75 s per image.
    batch([108.2, 108.7, 109.2], 109.5, kept=2)
    batch([109.7, 110.2, 110.7], 111.0, kept=2)
    # Ctrl-C: one interval of 0.5 s, then dropped; its time gives no image.
    batch([111.2, 111.7], 111.8, kept=None)
    assert times.first_batch_seconds == pytest.approx(8.0)
    assert times.seconds_per_step == pytest.approx(0.5)  # 7 intervals, none with a first call or prompt encoding
    assert times.seconds_per_image == pytest.approx(0.75)
    text = times.describe({"compile_seconds": 4.0})
    assert text == ("first batch 8.0s (first calls: OpenVINO compile 4.0s), "
                    "then 0.50 s/it, 0.75s per image after the first batch")
    text = times.describe({"compile_seconds": 4.0, "capture_seconds": 9.1, "captures_made": 3, "captures_saved": 3})
    assert text.startswith("first batch 8.0s (first calls: graph capture 9.1s, 3 captured and saved for the next "
                           "run; OpenVINO compile 4.0s), then")
    text = times.describe({"compile_seconds": 1.0, "capture_seconds": 0.9, "captures_loaded": 2})
    assert text.startswith("first batch 8.0s (first calls: graph capture 0.9s, 2 loaded from the cache; OpenVINO")


def test_run_times_with_one_batch_give_no_steady_per_image_time() -> None:
    clock = FakeClock()
    times = Progress(clock=clock)
    times.batch_started()
    clock.now = 103.0
    times.step()
    clock.now = 104.0
    times.batch_done(1)
    assert times.seconds_per_image is None and times.seconds_per_step is None
    assert times.describe(None) == "first batch 4.0s"


def test_cache_list_gives_sizes_in_binary_units(tmp_path: Path, capsys) -> None:
    entry = tmp_path / "cache" / "models" / "abc123"
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text('{"description": "graph 0"}'.ljust(1536))  # 1.5 * 1024 bytes
    assert main(["cache", "list", "--cache-dir", str(tmp_path / "cache")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"abc123\s+1\.5 KiB\s", lines[0]), lines
    assert lines[-1] == f"1 entries, 1.5 KiB in {tmp_path / 'cache'}"


def test_generate_reports_calls_dynamo_ran_in_pytorch(tmp_path: Path, sd1_checkpoint: Path, capsys,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A part that cannot be captured ahead of time (e.g. a graph break) runs through torch.compile, whose
    recompile limit applies: at 1, with no size marked as varying (here none is), the UNet's second prompt
    length (a 154-token context) runs uncompiled, and the run says so, as the WebUI's status does."""
    import torch

    from ov_accelerate_sd import accelerate, parts
    from ov_backend import portable

    def cannot(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a graph break (stand-in)")

    monkeypatch.setattr(portable, "capture", cannot)
    monkeypatch.setattr(accelerate, "VARYING_DIMS", {})  # (marked, the prompt length would not recompile)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n" + "word " * 90 + "\n", encoding="utf-8")
    argv = ["generate", "--checkpoint", str(sd1_checkpoint), "--prompts-file", str(prompts), "--seed", "1",
            *SMALL, "--precision", "f32", "--no-cache", "--out", str(tmp_path / "out"),
            "--pytorch", "vae", "--pytorch", "text_encoder"]
    with torch._dynamo.config.patch(recompile_limit=1):
        assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: Not accelerated, ran in plain PyTorch: unet (" in err, err
    assert "torch.compile gave up on it: dynamo's recompile limit (1 compiled variants" in err, err
    torch._dynamo.reset()
    again = ["generate", "--checkpoint", str(sd1_checkpoint), "--prompt", "a red cat", "--seed", "1", *SMALL,
             "--precision", "f32", "--no-cache", "--out", str(tmp_path / "again"), "--pytorch", "vae",
             "--pytorch", "text_encoder"]
    with torch._dynamo.config.patch(recompile_limit=1):
        assert main(again) == 0  # one prompt length: every call compiled, nothing to report
    assert "Not accelerated" not in capsys.readouterr().err
    torch._dynamo.reset()
    monkeypatch.setattr(accelerate, "VARYING_DIMS", parts.VARYING_DIMS)
    marked = [*argv[:-5], str(tmp_path / "marked"), *argv[-4:]]
    with torch._dynamo.config.patch(recompile_limit=1):
        assert main(marked) == 0  # the prompt length marked as varying: one graph serves both lengths
    assert "Not accelerated" not in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("nncf") is None, reason="nncf is not installed")
def test_int8_calibrates_on_the_first_batch_and_a_new_run_reads_it_from_the_cache(tmp_path: Path) -> None:
    """The first batch is recorded at float, the UNet quantized, the batch rendered again at INT8: its image is the
    one a run that reads the INT8 model from the cache makes."""
    cache = tmp_path / "cache"
    args = ["-v", "generate", "--demo", "--prompt", "a cat", *SMALL, "--seed", "3", "--precision", "int8",
            "--cache-dir", str(cache)]
    proc = _run(*args, "--batch-count", "2", "--out", str(tmp_path / "first"))
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    # the first batch's 2 steps ran at float and were recorded; the UNet was quantized after it
    (line,) = [x for x in stdout.splitlines() if x.startswith("INT8: ")]
    assert "INT8 quantization; calibrated on 2 recorded call(s)" in line
    assert line.endswith("the batch renders again at INT8")
    assert "INT8 model" in stderr and "int8" in stderr  # the second batch's UNet report (-v)
    info = parse_infotext(read_png_infotext(tmp_path / "first" / "00001-4.png"))
    assert info["OpenVINO"].endswith(", int8"), info["OpenVINO"]

    proc = _run(*args, "--out", str(tmp_path / "again"))
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert not [x for x in stdout.splitlines() if x.startswith("INT8: ")]  # nothing to calibrate again
    assert "INT8 model from the cache" in stderr
    first = (tmp_path / "first" / "00000-3.png").read_bytes()
    assert (tmp_path / "again" / "00000-3.png").read_bytes() == first


def test_int8_without_nncf_is_a_usage_error(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nncf" else real(name, *a))
    err = _usage_error(["generate", "--demo", "--precision", "int8"], capsys)
    assert "INT8 needs NNCF" in err and "pip install nncf==3.4.0" in err


def test_generate_keeps_the_cache_under_its_limit_but_never_what_it_uses(tmp_path: Path) -> None:
    """--cache-max-size parses as 'cache prune --max-size' and defaults to the backend's limit; a run with a limit
    below what it stores removes the older entries after each store, keeps its own, says so, and makes its image."""
    import openvino as ov

    from ov_backend import DEFAULT_CACHE_MAX_BYTES, ModelCache

    gen = build_parser().parse_args(["generate", "--demo"])
    assert gen.cache_max_size == DEFAULT_CACHE_MAX_BYTES == 20 << 30
    assert build_parser().parse_args(["generate", "--demo", "--cache-max-size", "1.5G"]).cache_max_size == \
        parse_size("1.5G") == 3 << 29
    cache_dir = tmp_path / "cache"
    old = ModelCache(cache_dir)
    param = ov.opset13.parameter([1, 4], ov.Type.f32)
    old.store("an-old-model", ov.Model([ov.opset13.relu(param)], [param], "old"), "from an earlier run")
    os.utime(old.models_dir / "an-old-model" / "meta.json", (1, 1))
    proc = _run("generate", "--demo", "--prompt", "a cat", *SMALL, "--seed", "3", "--precision", "f32",
                "--cache-dir", str(cache_dir), "--cache-max-size", "1K", "--out", str(tmp_path / "out"))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert (tmp_path / "out" / "00000-3.png").is_file()
    keys = {e.key for e in ModelCache(cache_dir).entries()}
    assert "an-old-model" not in keys and keys  # this run's entries stay: they were in use until it ended
    (line,) = [line for line in stdout.splitlines() if line.startswith("disk cache: ")]
    assert "of 1.0 KiB limit (over it:" in line and "in use" in line, stdout
    assert re.search(r"removed [1-9]\d* least recently used entries", line), line
    assert "over its limit of 1.0 KiB" in stderr  # the WARNING, once
    assert stderr.count("over its limit") == 1, stderr
