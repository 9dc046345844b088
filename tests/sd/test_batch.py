"""``python -m ov_backend batch``: a job file rendered into a folder, checked before it renders, resumed after a
kill with the same images bit for bit, on ``--workers 2`` and on a local Ray cluster with a worker killed."""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from ov_accelerate_sd.batch_manifest import MANIFEST, Manifest, ManifestError
from ov_accelerate_sd.cli import main
from ov_accelerate_sd.pnginfo import parse_infotext, read_png_infotext
from ov_accelerate_sd.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
HAVE_RAY = importlib.util.find_spec("ray") is not None
PYTORCH_ONLY = ["--pytorch", "unet", "--pytorch", "vae", "--pytorch", "text_encoder"]


def write_jobs(path: Path, lines: list) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n",
                    encoding="utf-8")
    return path


def pngs(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def records(folder: Path) -> list[dict]:
    return [json.loads(row) for row in (folder / MANIFEST).read_text().splitlines() if row.strip()]


def batch(*args: str, verbose: bool = False, **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
    return subprocess.Popen([sys.executable, "-m", "ov_backend", *(["-v"] if verbose else []), "batch", *args],
                            env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def killed_at(args: list[str], row: str) -> None:
    """Run ``batch`` with ``args`` and SIGKILL it once it prints a progress row starting with ``row``."""
    proc = batch(*args)
    for printed in proc.stdout:
        if printed.startswith(row):
            proc.send_signal(signal.SIGKILL)
            break
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture(scope="module")
def init_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("init") / "start.png"
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_lora(path: Path, checkpoint: Path) -> Path:
    """A kohya LoRA (the WebUI's LDM layer names) on every attention projection of the checkpoint's UNet."""
    import torch
    from safetensors.torch import save_file

    from ov_accelerate_sd.checkpoint import read_checkpoint

    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for name, weight in read_checkpoint(checkpoint).state_dict.items():
        if ".attn" in name and name.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")):
            key = "lora_unet_" + name[len("model.diffusion_model."):-len(".weight")].replace(".", "_")
            out, inp = weight.shape
            tensors[f"{key}.lora_down.weight"] = torch.randn(2, inp, generator=gen) / inp**0.5
            tensors[f"{key}.lora_up.weight"] = torch.randn(out, 2, generator=gen) * 0.5
            tensors[f"{key}.alpha"] = torch.tensor(2.0)
    assert tensors
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def mixed_job(tmp_path_factory: pytest.TempPathFactory, sd1_checkpoint: Path, init_image: Path) -> Path:
    """Two sizes, two samplers, a batch of two, a LoRA (in ``loras/`` beside the job), img2img with a path relative
    to the job file, a blank line."""
    folder = tmp_path_factory.mktemp("job")
    (folder / "in").mkdir()
    (folder / "in" / "start.png").write_bytes(init_image.read_bytes())
    write_lora(folder / "loras" / "style.safetensors", sd1_checkpoint)
    return write_jobs(folder / "job.jsonl", [
        {"prompt": "a red barn", "seed": 11},
        {"prompt": "a blue (boat:1.3)", "seed": 20, "width": 96, "sampler": "DPM++ 2M Karras", "batch_size": 2},
        "",
        {"prompt": "a green field", "negative_prompt": "fog", "seed": 30, "init_image": "in/start.png",
         "denoising_strength": 0.6},
        {"prompt": "a yellow kite", "seed": 40, "steps": 3, "checkpoint": str(sd1_checkpoint)},
        {"prompt": "a red barn <lora:style:1>", "seed": 11},
    ])


@pytest.fixture(scope="module")
def one_go(tmp_path_factory: pytest.TempPathFactory, mixed_job: Path, sd1_checkpoint: Path) -> tuple[Path, Path]:
    """The mixed job through OpenVINO at f32 in one go: (output folder, the disk cache it warmed)."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("one-go") / "out"
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), verbose=True)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert "job: 5 line(s), 6 image(s); 0 already in" in stdout
    assert "6 image(s) rendered into" in stdout and "6 of 6 done" in stdout
    # the LoRA line (after a line of the same size) compiled the UNet for its weights, converting nothing
    assert "conversion reused for the new weights" in stderr
    return out, cache


def job_options(job: Path, checkpoint: Path, cache: Path, out: Path) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--width", "64", "--height", "64", "--steps", "2", "--precision", "f32",
            "--cache-dir", str(cache), "--lora-dir", str(job.parent / "loras"), "--out", str(out)]


def test_a_mixed_job_renders_every_image_once_with_the_webuis_infotext(one_go: tuple[Path, Path],
                                                                       sd1_checkpoint: Path) -> None:
    out, _ = one_go
    made = pngs(out)
    assert sorted(made) == ["00001-00-11.png", "00002-00-20.png", "00002-01-21.png", "00004-00-30.png",
                            "00005-00-40.png", "00006-00-11.png"]
    info = {name: parse_infotext(read_png_infotext(out / name)) for name in made}
    assert info["00001-00-11.png"]["Size"] == "64x64" and info["00001-00-11.png"]["Sampler"] == "Euler a"
    blue = info["00002-01-21.png"]
    assert blue["Prompt"] == "a blue (boat:1.3)" and blue["Size"] == "96x64" and blue["Seed"] == "21"
    assert blue["Sampler"] == "DPM++ 2M" and blue["Schedule type"] == "Karras"
    img2img = info["00004-00-30.png"]
    assert img2img["Denoising strength"] == "0.6" and img2img["Negative prompt"] == "fog"
    assert info["00005-00-40.png"]["Steps"] == "3"
    lora = info["00006-00-11.png"]
    assert lora["Prompt"] == "a red barn <lora:style:1>" and lora["Lora hashes"].startswith("style: ")
    assert "Lora hashes" not in info["00001-00-11.png"]
    assert psnr(made["00006-00-11.png"], made["00001-00-11.png"]) < 30  # the LoRA moved the picture
    assert all(i["OpenVINO"] == "CPU, UNet+VAE+TE, f32" and i["Model"] == sd1_checkpoint.stem for i in info.values())
    with Image.open(out / "00002-00-20.png") as img:
        assert img.size == (96, 64)
    images = [r for r in records(out) if r["kind"] == "image"]
    assert sorted(r["file"] for r in images) == sorted(made)  # each recorded once
    # the img2img line is not the txt2img picture of its seed: the init image was used
    assert made["00004-00-30.png"] != made["00001-00-11.png"]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_killed_mid_job_and_resumed_gives_the_same_images_bit_for_bit(one_go: tuple[Path, Path], mixed_job: Path,
                                                                      sd1_checkpoint: Path, tmp_path: Path) -> None:
    reference, cache = one_go
    out = tmp_path / "out"
    args = [str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out)]
    killed_at(args, "[2/6]")
    before = pngs(out)
    assert 2 <= len(before) < 6

    proc = batch(*args)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    done = len([r for r in records(out) if r["kind"] == "image"])
    assert f"job: 5 line(s), 6 image(s); {len(before)} already in" in stdout
    assert pngs(out) == pngs(reference)  # every image, the same bytes as the run in one go
    assert {name: pngs(out)[name] for name in before} == before  # what was done was kept, not redone
    assert done == 6 and not list(out.glob(".*.tmp"))

    proc = batch(*args)  # a third time: nothing left
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    assert "6 already in" in stdout and "0 to render" in stdout and "0 image(s) rendered" in stdout


NEEDS_NNCF = pytest.mark.skipif(importlib.util.find_spec("nncf") is None, reason="nncf is not installed")


@pytest.fixture(scope="module")
def int8_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sizes at INT8, 5 steps (5 UNet calls a batch: fewer than the 8 a graph records at most); lines 1 and 2
    run the same graph, so two workers start it at once."""
    return write_jobs(tmp_path_factory.mktemp("int8-job") / "job.jsonl", [
        {"prompt": "a red barn", "seed": 11},
        {"prompt": "a blue boat on a lake", "seed": 20},
        {"prompt": "a green field", "seed": 30, "width": 96, "batch_size": 2},
        {"prompt": "a yellow kite", "seed": 40},
        {"prompt": "a blue cat", "seed": 60, "width": 96, "batch_size": 2},
    ])


def int8_options(job: Path, checkpoint: Path, cache: Path | None, out: Path) -> list[str]:
    return [str(job), "--checkpoint", str(checkpoint), "--width", "64", "--height", "64", "--steps", "5",
            "--precision", "int8", *(["--cache-dir", str(cache)] if cache else ["--no-cache"]), "--out", str(out)]


@pytest.fixture(scope="module")
def int8_one_go(tmp_path_factory: pytest.TempPathFactory, int8_job: Path, sd1_checkpoint: Path) -> tuple[Path, Path]:
    """The INT8 job in one process: (its images, the disk cache it warmed)."""
    folder = tmp_path_factory.mktemp("int8-one-go")
    proc = batch(*int8_options(int8_job, sd1_checkpoint, folder / "cache", folder / "out"))
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    quantized = [row for row in stdout.splitlines() if row.startswith("INT8: ")]
    assert len(quantized) == 2, stdout  # one graph a size, each on its first batch's 5 calls
    assert all("calibrated on 5 recorded call(s)" in row and row.endswith("the batch renders again at INT8")
               for row in quantized), quantized
    assert len(pngs(folder / "out")) == 7
    return folder / "out", folder / "cache"


@NEEDS_NNCF
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_an_int8_job_gives_the_same_images_on_two_workers_killed_and_resumed_and_on_a_warm_cache(
        int8_one_go: tuple[Path, Path], int8_job: Path, sd1_checkpoint: Path, tmp_path: Path) -> None:
    """Each UNet graph (one a size) is quantized on the job's first batch that runs it, on that batch's calls alone
    (it used to go on recording into the next batch of its size), and that batch renders again at INT8. Two workers
    start lines 1 and 2 at once: the one with line 2 samples line 1 to calibrate (it used to calibrate on line 2)."""
    reference, cache = int8_one_go
    proc = batch(*int8_options(int8_job, sd1_checkpoint, tmp_path / "cache-workers", tmp_path / "workers"),
                 "--workers", "2")
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert pngs(tmp_path / "workers") == pngs(reference), stdout

    # killed once the second size's first batch is saved, then resumed, on a disk cache of its own
    args = int8_options(int8_job, sd1_checkpoint, tmp_path / "cache-killed", tmp_path / "killed")
    killed_at(args, "[4/7]")
    assert 4 <= len(pngs(tmp_path / "killed")) < 7
    proc = batch(*args)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert pngs(tmp_path / "killed") == pngs(reference)

    # one process, into a new folder, on the workers' cache (their INT8 models were quantized on 1 pinned thread
    # each, its own run on every core: the thread placement is not in the INT8 keys): nothing runs at float
    proc = batch(*int8_options(int8_job, sd1_checkpoint, tmp_path / "cache-workers", tmp_path / "warm"))
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr
    assert not [row for row in stdout.splitlines() if row.startswith("INT8: ")], stdout
    assert pngs(tmp_path / "warm") == pngs(reference)


@NEEDS_NNCF
def test_a_batch_rendered_first_calibrates_on_the_jobs_first_batch_of_its_graph(tmp_path: Path,
                                                                              sd1_checkpoint: Path) -> None:
    """A renderer given line 3 first (as a worker may be) learns line 1's graphs by sampling it (line 1 cannot
    render: its LoRA is missing, so it calibrates nothing), finds line 2 to be the first batch of line 3's graph,
    samples it to calibrate, and makes line 3's image of a run in the job's order."""
    from ov_accelerate_sd.jobs import JobLine
    from ov_accelerate_sd.render import Renderer, RenderOptions, RenderTask, tasks_of

    def line(number: int, prompt: str, width: int) -> JobLine:
        return JobLine(number=number, prompt=prompt, negative_prompt="", seed=number, width=width, height=64, steps=3,
                       sampler="Euler a", cfg_scale=7.0, batch_size=1, batch_count=1, checkpoint=str(sd1_checkpoint),
                       precision="int8", step_cache=1, init_image="", denoising_strength=0.75, clip_skip=1)

    lines = [line(1, "a barn <lora:missing:1>", 96), line(2, "a red barn", 64), line(3, "a blue boat", 64)]
    order = tasks_of((one, one.seed) for one in lines)
    said: list[str] = []

    def images(tasks: list[JobLine], cache: str) -> list[bytes]:
        renderer = Renderer(RenderOptions(cache_dir=str(tmp_path / cache), lora_dirs=(str(tmp_path),),
                                               order=order), said.append)
        try:
            return [item.image.tobytes() for one in tasks for item in renderer.render(RenderTask(one, one.seed, 0))]
        finally:
            renderer.close()

    in_order = images(lines[1:], "in-order")  # (line 1 fails, before any step, as its LoRA is missing)
    assert not [text for text in said if "is the job's first batch" in text]  # each graph on the batch it renders
    said.clear()
    (alone,) = images(lines[2:], "alone")
    assert alone == in_order[1]
    assert any("line 1's steps are sampled once" in text for text in said), said
    assert any("line 2 (batch 1) is the job's first batch to run a UNet graph line 3 runs" in text for text in said)
    quantized = [text for text in said if "INT8 quantization" in text]
    assert len(quantized) == 1 and "calibrated on 3 recorded call(s)" in quantized[0], said


def test_a_torn_record_and_a_half_written_png_are_redone(tmp_path: Path, sd1_checkpoint: Path) -> None:
    jobs = write_jobs(tmp_path / "j.jsonl", [{"prompt": "a cat", "seed": 3, "batch_count": 2}])
    out = tmp_path / "out"
    argv = ["batch", str(jobs), "--checkpoint", str(sd1_checkpoint), "--width", "64", "--height", "64",
            "--steps", "2", *PYTORCH_ONLY, "--out", str(out)]
    assert main(argv) == 0
    reference = pngs(out)
    # What a kill can leave: the last record torn, a temporary PNG, an image renamed before its record.
    text = (out / MANIFEST).read_text()
    (out / MANIFEST).write_text(text[: text.rindex("{") + 25])
    (out / ".00001-01-4.png.1234abcd.tmp").write_bytes(b"\x89PNG half")
    assert main(argv) == 0
    assert pngs(out) == reference and not list(out.glob(".*.tmp"))
    assert [r["file"] for r in records(out) if r["kind"] == "image"] == ["00001-00-3.png", "00001-01-4.png"]


def test_bad_lines_are_listed_with_their_numbers_and_nothing_renders(tmp_path: Path, sd1_checkpoint: Path,
                                                                     capsys) -> None:
    not_a_model = tmp_path / "lora.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, str(not_a_model))
    jobs = write_jobs(tmp_path / "j.jsonl", [
        {"prompt": "fine", "seed": 1},
        {"prompt": "x", "sampler": "Euler b"},
        {"prompt": "x", "checkpoint": "missing.safetensors"},
        "",
        {"prompt": "x", "width": 100},
        '{"prompt": "x", "seed": 1',
        {"prompt": "x", "colour": "red"},
        ["not", "an", "object"],
        {"prompt": "x", "steps": "20"},
        {"prompt": "x", "checkpoint": str(not_a_model)},
        {"prompt": "x", "precision": "fp8"},
        {"negative_prompt": "no prompt"},
        {"prompt": "x", "init_image": "nowhere.png"},
        {"prompt": "x <lora:nowhere:1>"},
    ])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["batch", str(jobs), "--checkpoint", str(sd1_checkpoint), "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    expected = {
        2: "unknown sampler 'Euler b'; valid samplers:",
        3: "checkpoint missing.safetensors: no such file",
        5: "width 100 must be a multiple of 8 and at least 64",
        6: "not valid JSON",
        7: "unknown field(s) colour; valid fields: prompt, negative_prompt, seed",
        8: "a line must be one JSON object, got list",
        9: 'steps must be a number, got "20"',
        10: "not a Stable Diffusion checkpoint (it looks like a diffusers component, a LoRA or a VAE",
        11: "unknown precision 'fp8'; valid: auto, f32",
        12: "prompt is empty",
        13: "init_image nowhere.png: no such file",
        14: "no LoRA named 'nowhere'",
    }
    for number, message in expected.items():
        assert any(row.startswith(f"{jobs}:{number}: ") and message in row for row in err.splitlines()), (number, err)
    assert f"{jobs}:1:" not in err
    assert "12 bad line(s)" in err and "--skip-bad" in err
    assert not out.exists()


def test_skip_bad_renders_the_good_lines_and_lists_the_others(tmp_path: Path, sd1_checkpoint: Path, capsys) -> None:
    jobs = write_jobs(tmp_path / "j.jsonl", [{"prompt": "x", "width": 100}, {"prompt": "a dog", "seed": 8}])
    out = tmp_path / "out"
    assert main(["batch", str(jobs), "--checkpoint", str(sd1_checkpoint), "--width", "64", "--height", "64",
                 "--steps", "2", *PYTORCH_ONLY, "--skip-bad", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"{jobs}:1: width 100" in captured.err and "skipping 1 bad line(s)" in captured.err
    assert sorted(pngs(out)) == ["00002-00-8.png"]


def test_a_changed_line_is_refused_on_resume_and_a_new_line_renders(tmp_path: Path, sd1_checkpoint: Path,
                                                                    capsys) -> None:
    jobs = tmp_path / "j.jsonl"
    common = ["--checkpoint", str(sd1_checkpoint), "--width", "64", "--height", "64", *PYTORCH_ONLY,
              "--out", str(tmp_path / "out")]
    write_jobs(jobs, [{"prompt": "a cat", "seed": -1, "steps": 2}])
    assert main(["batch", str(jobs), *common]) == 0
    first = pngs(tmp_path / "out")
    write_jobs(jobs, [{"prompt": "a cat", "seed": -1, "steps": 3}])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["batch", str(jobs), *common])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "line 1: steps 2 -> 3" in err and "1 line(s) differ from the job this folder's run began with" in err
    # the same line again (its random seed kept), plus a new one
    write_jobs(jobs, [{"prompt": "a cat", "seed": -1, "steps": 2}, {"prompt": "a dog", "seed": 4, "steps": 2}])
    assert main(["batch", str(jobs), *common]) == 0
    now = pngs(tmp_path / "out")
    assert {k: now[k] for k in first} == first and len(now) == 2 and "00002-00-4.png" in now


def test_a_plain_prompts_file_and_a_job_file_not_ending_in_jsonl(tmp_path: Path, sd1_checkpoint: Path,
                                                                 capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n\n(a blue:1.2) dog\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["batch", str(prompts), "--out", str(tmp_path / "o")])
    assert "use --prompts-file" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["batch", "--prompts-file", str(prompts), "--checkpoint", str(sd1_checkpoint), "--seed", "5",
                 "--width", "64", "--height", "64", "--steps", "2", *PYTORCH_ONLY, "--out", str(out)]) == 0
    made = sorted(pngs(out))
    assert made == ["00001-00-5.png", "00003-00-5.png"]
    assert parse_infotext(read_png_infotext(out / made[1]))["Prompt"] == "(a blue:1.2) dog"


def test_one_run_at_a_time_writes_a_folder(tmp_path: Path) -> None:
    with Manifest(tmp_path):
        with pytest.raises(ManifestError, match="another batch run is writing"):
            Manifest(tmp_path)
    Manifest(tmp_path).close()  # free again once the first closed


def test_progress_gives_images_a_minute_and_time_left() -> None:
    now = [0.0]
    progress = Progress(total=10, done_before=4, clock=lambda: now[0])
    assert progress.left_text() == ""
    now[0] = 60.0
    progress.rendered = 2
    assert progress.per_minute == 2.0 and progress.left_text() == "2.00 images/min, 2.0 min left"
    progress.rendered = 6
    assert progress.left_text() == "6.00 images/min"


def worker_pids(parent: int) -> list[int]:
    """The pids of a process's worker children (multiprocessing's spawned workers, not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry.name))
    return found


def at_the_first_image(proc: subprocess.Popen, action: Callable[[str], Any],
                       timeout: float = 900) -> tuple[Any, str, str]:
    """Read a run's output; at its first image, call ``action`` with the output so far (once). Returns (what
    ``action`` returned, stdout, stderr) once the run ended."""
    seen: list[str] = []
    done, result = False, None
    for row in proc.stdout:
        seen.append(row)
        if row.startswith("[1/6]") and not done:
            done, result = True, action("".join(seen))
    stderr = proc.stderr.read()
    proc.wait(timeout=timeout)
    assert done, "".join(seen) + stderr
    return result, "".join(seen), stderr


def kill_a_worker_at_the_first_image(proc: subprocess.Popen, find: Callable[[], list[int]]) -> tuple[int, str, str]:
    """At the run's first image, SIGKILL one of the two workers ``find`` returns (waiting up to a minute for both).
    Returns (the killed pid, stdout, stderr) once the run ended."""
    def kill(seen: str) -> int:
        deadline = time.monotonic() + 60
        while len(workers := find()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2, seen
        os.kill(workers[0], signal.SIGKILL)
        return workers[0]

    return at_the_first_image(proc, kill)


def psnr(a: bytes, b: bytes) -> float:
    import io

    x, y = (np.asarray(Image.open(io.BytesIO(data)), dtype=np.float64) for data in (a, b))
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="two cores and /proc")
def test_two_workers_with_one_killed_mid_job_make_every_image_once(one_go: tuple[Path, Path], mixed_job: Path,
                                                                   sd1_checkpoint: Path, tmp_path: Path) -> None:
    reference, cache = one_go
    out = tmp_path / "out"
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), "--workers", "2", verbose=True)
    _, stdout, stderr = kill_a_worker_at_the_first_image(proc, lambda: worker_pids(proc.pid))
    assert proc.returncode == 0, stderr
    assert "2 workers (2 requested)" in stdout
    # -v: each worker's compile reports, named by worker (the driver renders nothing itself)
    assert any(row.startswith("worker ") and "partition" in row.lower() for row in stderr.splitlines()), stderr
    assert "a worker process ended unexpectedly" in stdout and "go to new workers" in stdout
    made = pngs(out)
    expected = pngs(reference)
    assert sorted(made) == sorted(expected)
    assert sorted(r["file"] for r in records(out) if r["kind"] == "image") == sorted(expected)  # each once
    # each worker computes on 1 thread, the one-process run on 2: the same bytes
    assert made == expected


def ctrl_c_at_the_first_image(proc: subprocess.Popen, find: Callable[[], list[int]]) -> tuple[list[int], str, str]:
    """At the run's first image, SIGINT the command (as Ctrl-C in its terminal does). Returns (the worker pids
    ``find`` saw then, stdout, stderr) once the run ended."""
    def interrupt(_seen: str) -> list[int]:
        workers = find()
        proc.send_signal(signal.SIGINT)
        return workers

    return at_the_first_image(proc, interrupt, timeout=600)


def gone(pids: list[int], within: float = 60.0) -> bool:
    """Whether every one of ``pids`` has ended (or is a zombie) within ``within`` seconds."""
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(pid) for pid in pids)


def assert_stopped_cleanly(out: Path, stdout: str, stderr: str, returncode: int) -> None:
    """Exit 130 with the message, and every image the manifest records is in the folder, whole."""
    assert returncode == 130, stdout + stderr
    assert "stopped by Ctrl-C" in stderr, stderr
    done = [r["file"] for r in records(out) if r["kind"] == "image"]
    assert 1 <= len(done) < 6, done
    for name in done:
        with Image.open(out / name) as image:
            image.load()


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="two cores and /proc")
def test_ctrl_c_stops_the_workers_and_keeps_what_was_saved(
        one_go: tuple[Path, Path], mixed_job: Path, sd1_checkpoint: Path, tmp_path: Path) -> None:
    """(The same command then resumes from the manifest as after a kill: the kill-and-resume tests.)"""
    _, cache = one_go
    out = tmp_path / "out"
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), "--workers", "2")
    workers, stdout, stderr = ctrl_c_at_the_first_image(proc, lambda: worker_pids(proc.pid))
    assert_stopped_cleanly(out, stdout, stderr, proc.returncode)
    assert len(workers) == 2 and gone(workers, within=5), workers  # the workers end with the command


def test_workers_are_planned_from_the_cores_and_the_memory() -> None:
    from ov_accelerate_sd.pool import plan_workers

    gib = 1 << 30
    plan = plan_workers(2, 5 * gib, 24 * gib, [0, 1], batches=10)
    assert plan.workers == 2 and plan.core_sets == ((0,), (1,))
    with pytest.raises(ValueError, match=r"--workers 4 would hold about 20.0 GiB .*--workers 2 fits"):
        plan_workers(4, 5 * gib, 12 * gib, list(range(8)), batches=10)
    with pytest.raises(ValueError, match="may use 2 core"):
        plan_workers(3, gib, 24 * gib, [0, 1], batches=10)
    auto = plan_workers(None, 5 * gib, 32 * gib, list(range(16)), batches=10)
    assert auto.workers == 4 and auto.core_sets[0] == (0, 1, 2, 3)  # 4 cores a worker
    assert plan_workers(None, 5 * gib, 12 * gib, list(range(16)), batches=10).workers == 2  # memory for 2
    assert plan_workers(None, gib, 24 * gib, [0, 1], batches=10).workers == 1
    assert plan_workers(2, gib, 24 * gib, [0, 1, 2], batches=1).workers == 1  # one batch: one worker
    assert plan_workers(2, gib, None, [0, 1, 2], batches=5).core_sets == ((0, 1), (2,))



def test_a_clusters_workers_are_planned_from_its_nodes_by_the_same_planner() -> None:
    """Without --ray-cpus-per-worker a worker takes up to 4 CPUs, fewer when no node has 4: a 2-CPU head runs one
    worker of 2 (it was refused, asking 4); a worker's CPUs are on one node."""
    from ov_accelerate_sd.pool import plan_workers

    gib = 1 << 30
    head = plan_workers(None, gib, 24 * gib, [0, 1], batches=10, nodes=[2])
    assert head.workers == 1 and head.cores_per_worker == 2 and "chosen from the nodes" in head.reason
    two = plan_workers(None, gib, 24 * gib, list(range(12)), batches=10, nodes=[8, 4])
    assert two.workers == 3 and two.cores_per_worker == 4
    assert plan_workers(None, gib, 24 * gib, [0, 1], batches=10, nodes=[2], cores_per_worker=1).workers == 2
    assert plan_workers(None, 5 * gib, 6 * gib, list(range(8)), batches=10, nodes=[8]).workers == 1  # memory for 1
    with pytest.raises(ValueError, match=r"a worker needs 4 CPU\(s\) on one node"):
        plan_workers(None, gib, 24 * gib, [0, 1, 2, 3], batches=10, nodes=[2, 2], cores_per_worker=4)
    with pytest.raises(ValueError, match=r"--workers 3: the cluster holds 2 worker\(s\) of 1 CPU"):
        plan_workers(3, gib, 24 * gib, [0, 1], batches=10, nodes=[2], cores_per_worker=1)


def test_a_workers_memory_estimate_covers_the_measured_peaks(monkeypatch) -> None:
    """The estimate a plan refuses an N by holds the peaks measured on full-size SD 1.5: 5.65 GiB a worker at f32,
    9.3 at INT8 (NNCF's quantization; bench/results/batch-sd15-identical-f32-zen4-2026-11-28.md,
    batch-sd15-int8-zen4-2026-11-28.md)."""
    from ov_accelerate_sd import pool

    sd15_parameters = 859_520_964 + 83_653_863 + 123_060_480  # UNet, VAE, text encoder
    monkeypatch.setattr(pool, "checkpoint_parameters", lambda path: sd15_parameters)
    gib = 1 << 30
    assert pool.worker_bytes([("sd15.safetensors", "f32")]) > 5.65 * gib
    assert pool.worker_bytes([("sd15.safetensors", "int8")]) > 9.3 * gib
    assert pool.worker_bytes([("sd15.safetensors", "f32"), ("sd15.safetensors", "int8")]) > 9.3 * gib


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A local Ray cluster of 2 CPUs (``ray start --head``) with token authentication (a token of its own, given to
    Ray in ``RAY_AUTH_TOKEN``, as docs/batch.md says to start one): its address and the environment a driver needs
    to reach it. Stopped afterwards."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # a short path: Ray's sockets live under it
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **auth)
    subprocess.run([str(RAY), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats", f"--temp-dir={temp}"], env=env, check=True, capture_output=True,
                   timeout=300)
    try:
        yield f"127.0.0.1:{port}", auth
    finally:
        subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True, timeout=300)


def ray_workers() -> list[int]:
    """The pids of the cluster's render workers (Ray names a worker process after its actor class)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::RenderWorker"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.skipif(not HAVE_RAY or not sys.platform.startswith("linux"),
                    reason="the optional extra requirements-ray.txt, and /proc")
def test_a_ray_cluster_of_two_workers_with_one_killed_makes_every_image_once(
        cluster: tuple[str, dict[str, str]], one_go: tuple[Path, Path], mixed_job: Path, sd1_checkpoint: Path,
        tmp_path: Path) -> None:
    reference, cache = one_go
    address, auth = cluster
    out = tmp_path / "out"
    # a driver that names the address shows the cluster's token (docs/batch.md)
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), "--ray", address,
                 "--ray-cpus-per-worker", "1", **auth)
    killed, stdout, stderr = kill_a_worker_at_the_first_image(proc, ray_workers)
    assert proc.returncode == 0, stdout + stderr
    assert f"Ray cluster at {address}: 2 CPU(s), 2 worker(s) of 1 CPU(s)" in stdout
    assert killed not in ray_workers()
    made, expected = pngs(out), pngs(reference)
    assert sorted(made) == sorted(expected)
    assert sorted(r["file"] for r in records(out) if r["kind"] == "image") == sorted(expected)  # each written once
    # a worker computes on 1 thread, the one-process run on 2: the same bytes
    assert made == expected
    # the killed worker's batch ran again on the worker Ray started in its place
    assert "6 image(s) rendered" in stdout


@pytest.fixture
def three_nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[Any], dict[str, str]]]:
    """A local Ray cluster of three nodes of 1 CPU each on this machine (Ray's own ``cluster_utils.Cluster``, which
    starts each node's processes as ``ray start`` would): (the cluster, its two nodes besides the head, the driver's
    environment). Without token authentication: Ray reads ``RAY_AUTH_MODE`` in ``ray start``'s command line, which
    this test process does not go through (the token itself is the other cluster's test)."""
    from ray.cluster_utils import Cluster

    auth = {"RAY_AUTH_MODE": "disabled"}
    for key, value in {**auth, "RAY_USAGE_STATS_ENABLED": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    node = {"num_cpus": 1, "object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        others = [cluster.add_node(**node) for _ in range(2)]
        cluster.wait_for_nodes()
        yield cluster, others, auth
    finally:
        cluster.shutdown()


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@NEEDS_NNCF
@pytest.mark.skipif(not HAVE_RAY, reason="the optional extra requirements-ray.txt")
def test_an_int8_job_on_ray_without_a_disk_cache_gives_the_images_of_one_process(
        cluster: tuple[str, dict[str, str]], int8_one_go: tuple[Path, Path], int8_job: Path, sd1_checkpoint: Path,
        tmp_path: Path) -> None:
    """Two workers that share no cache (``--no-cache``, as on two nodes): each calibrates every graph it needs on the
    job's first batch that runs it, sampling that batch itself when another worker renders it."""
    reference, _ = int8_one_go
    address, auth = cluster
    proc = batch(*int8_options(int8_job, sd1_checkpoint, None, tmp_path / "out"), "--ray", address,
                 "--ray-cpus-per-worker", "1", **auth)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout + stderr
    assert pngs(tmp_path / "out") == pngs(reference)


@pytest.mark.skipif(not HAVE_RAY or not sys.platform.startswith("linux"),
                    reason="the optional extra requirements-ray.txt, and /proc")
def test_a_whole_node_lost_mid_job_its_batch_runs_on_another_and_every_image_is_made_once(
        three_nodes: tuple[Any, list[Any], dict[str, str]], one_go: tuple[Path, Path], mixed_job: Path,
        sd1_checkpoint: Path, tmp_path: Path) -> None:
    """Two workers on a cluster of three nodes; at the first image the node of a worker (not the head, where the
    driver is) goes: its raylet and every process on it killed at once. Ray starts the worker again on the spare
    node and its batch runs there."""
    cluster, others, auth = three_nodes
    reference, cache = one_go
    out = tmp_path / "out"
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), "--ray", cluster.address,
                 "--ray-cpus-per-worker", "1", "--workers", "2", **auth)
    raylets = {node.all_processes["raylet"][0].process.pid: node for node in others}

    def lose_a_workers_node(seen: str) -> Any:
        hosts = [raylets.get(parent_pid(pid)) for pid in ray_workers()]
        lost = next((node for node in hosts if node is not None), None)
        assert lost is not None, ("no worker on a node besides the head", seen)
        cluster.remove_node(lost, allow_graceful=False)
        return lost

    _, stdout, stderr = at_the_first_image(proc, lose_a_workers_node)
    assert proc.returncode == 0, stdout + stderr
    assert f"Ray cluster at {cluster.address}: 3 CPU(s), 2 worker(s) of 1 CPU(s)" in stdout
    made, expected = pngs(out), pngs(reference)
    assert sorted(made) == sorted(expected)
    assert sorted(r["file"] for r in records(out) if r["kind"] == "image") == sorted(expected)  # each written once
    assert made == expected
    assert "6 image(s) rendered" in stdout


@pytest.mark.skipif(not HAVE_RAY or not sys.platform.startswith("linux"),
                    reason="the optional extra requirements-ray.txt, and /proc")
def test_ctrl_c_on_a_ray_job_stops_its_workers_and_keeps_what_was_saved(
        cluster: tuple[str, dict[str, str]], one_go: tuple[Path, Path], mixed_job: Path, sd1_checkpoint: Path,
        tmp_path: Path) -> None:
    _, cache = one_go
    address, auth = cluster
    out = tmp_path / "out"
    # no --ray-cpus-per-worker: the 2-CPU cluster runs one worker of its 2 CPUs (the default asked 4 and was refused)
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, cache, out), "--ray", address, **auth)
    workers, stdout, stderr = ctrl_c_at_the_first_image(proc, ray_workers)
    assert_stopped_cleanly(out, stdout, stderr, proc.returncode)
    assert f"Ray cluster at {address}: 2 CPU(s), 1 worker(s) of 2 CPU(s) (chosen from the nodes)" in stdout
    assert workers and gone(workers), workers  # Ray ends the job's actors once its driver has gone


@pytest.mark.skipif(not HAVE_RAY, reason="the optional extra requirements-ray.txt")
def test_a_driver_without_the_clusters_token_is_told_how_to_give_it(
        cluster: tuple[str, dict[str, str]], mixed_job: Path, sd1_checkpoint: Path, tmp_path: Path) -> None:
    address, _ = cluster
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no-token-here")}
    proc = batch(str(mixed_job), *job_options(mixed_job, sd1_checkpoint, tmp_path / "cache", tmp_path / "out"),
                 "--ray", address, **env)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2, stdout + stderr
    assert f"--ray {address}: no Ray cluster answered" in stderr and "RAY_AUTH_TOKEN" in stderr, stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.png"))


def test_without_ray_the_option_says_how_to_install_it(tmp_path: Path, sd1_checkpoint: Path, monkeypatch,
                                                       capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    jobs = tmp_path / "j.jsonl"
    jobs.write_text(json.dumps({"prompt": "x", "seed": 1}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["batch", str(jobs), "--checkpoint", str(sd1_checkpoint), "--ray", "auto", "--out", str(tmp_path / "o")])
    assert info.value.code == 2
    assert "pip install -r requirements-ray.txt" in capsys.readouterr().err
