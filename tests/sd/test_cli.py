"""The command line end to end: generate (demo, prompts file, batch, img2img), devices, cache, Ctrl-C, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ov_accelerate_sd.cli import main, parse_size
from ov_accelerate_sd.pnginfo import parse_infotext, read_png_infotext

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
        (["generate", "--prompt", "x"], "one of the arguments --checkpoint --demo is required"),
        (["generate", "--demo", "--init-image", "/no/such.png"], "cannot read the image"),
        (["cache", "prune"], "needs --max-size"),
        (["cache", "list", "--max-size", "2G"], "only applies to 'cache prune'"),
        (["cache", "prune", "--max-size", "lots"], "is not a size"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list, message: str, capsys, tmp_path: Path) -> None:
    assert message in _usage_error(argv + (["--out", str(tmp_path / "o")] if argv[0] == "generate" else []),
                                   capsys)
    assert not (tmp_path / "o").exists()


def test_bad_checkpoint_is_a_usage_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 16)
    err = _usage_error(["generate", "--checkpoint", str(bad), "--prompt", "x", *SMALL, "--out",
                        str(tmp_path / "o"), *PYTORCH_ONLY], capsys)
    assert str(bad) in err and "not a safetensors file" in err
    assert not list((tmp_path / "o").glob("*.png")) if (tmp_path / "o").exists() else True


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
    assert info["OpenVINO parts"] == "none"
    summary = capsys.readouterr().out
    assert "8 image(s)" in summary and "per image" in summary

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
    assert "OpenVINO calls" in stdout and "compile" in stdout and "per image" in stdout
    info = parse_infotext(read_png_infotext(out / "00000-3.png"))
    assert info["OpenVINO device"] == "CPU" and info["OpenVINO parts"] == "text_encoder+unet+vae"

    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    listed = capsys.readouterr().out
    assert "entries" in listed and not listed.startswith("0 entries")
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
