"""Drives a real AUTOMATIC1111 WebUI v1.10.1 from the test bed: install the extension as a user does,
start and stop the WebUI, call its HTTP API, compare pictures.

The test bed is built by ``.ci/build_testbed.py`` (``.ci/testbed`` runs it) into
``$A1111_ROOT`` (default ``build/a1111-testbed`` in the checkout). Each test session gets its own WebUI
data folder (``--data-dir``: models, extensions, config, outputs), so the shared test bed is never
changed. :class:`WebUI` is A1111's; its class attributes (launch flags, start marker, requirements file) and
:meth:`WebUI.prepare_models` are what another WebUI of the same front end changes (``tests/real_forge/forge.py``).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
EXTENSION_NAME = "sd-webui-openvino-accelerate"
SCRIPT_NAME = "accelerate with openvino"
CHECKPOINT_A = "ovtest-tiny-a.safetensors"
CHECKPOINT_B = "ovtest-tiny-b.safetensors"
STARTED = "Startup time:"  # what webui.py prints once its API and callbacks are in place
LAUNCH_FLAGS = [
    "--skip-torch-cuda-test",
    "--use-cpu",
    "all",
    "--no-half",
    "--precision",
    "full",
    "--skip-version-check",
    "--no-download-sd-model",
    "--api",
]


def testbed_root() -> Path:
    return Path(os.environ.get("A1111_ROOT") or ROOT / "build" / "a1111-testbed")


def testbed_ready(root: Path) -> bool:
    return (
        (root / "webui" / "launch.py").is_file()
        and (root / "venv" / "bin" / "python").is_file()
        and any((root / "hf-home" / "hub").glob("models--openai--clip-vit-large-patch14/snapshots/*/vocab.json"))
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_image(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64)


def encode_image(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two 8-bit pictures (inf when identical)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@dataclass
class Result:
    images: list[np.ndarray]
    info: dict[str, Any]
    seconds: float
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def infotexts(self) -> list[str]:
        return list(self.info.get("infotexts", []))


class WebUI:
    """One WebUI installation (data folder) that can be started, restarted and stopped."""

    launch_flags: tuple[str, ...] = tuple(LAUNCH_FLAGS)
    """The flags every start passes before :attr:`extra_flags`, ``--port``, ``--data-dir`` and ``--ckpt``."""
    started_marker = STARTED
    """What the WebUI prints once its API and callbacks are in place (no request before it)."""
    requirements_file = "requirements-a1111-py311.txt"
    """The test bed's requirements, for the WebUI's start-up check (``REQS_FILE``)."""
    name = "WebUI"
    """In errors ("the WebUI exited with ...", which the bench reads) and, lower-case, log file names."""

    def __init__(self, testbed: Path, data_dir: Path, log_dir: Path) -> None:
        self.testbed, self.data_dir, self.log_dir = testbed, data_dir, log_dir
        self.webui = testbed / "webui"
        self.python = testbed / "venv" / "bin" / "python"
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.log_path: Path | None = None
        self.checkpoint = CHECKPOINT_A
        """The checkpoint the WebUI loads at start (``--ckpt``), a file in the data folder's models."""
        self.extra_flags: list[str] = []
        """Launch flags after :data:`LAUNCH_FLAGS` (``--skip-install`` when another extension's installer
        would move pins)."""
        self.start_seconds = 0.0
        """How long the last :meth:`start` took, until the API answered."""

    # --- set-up ------------------------------------------------------------------------------------
    def prepare(self, extra_extensions: list[Path], tiny_models: bool = True) -> None:
        """Models made by LDM's own classes (unless ``tiny_models`` is false), the extension cloned into
        extensions/ as a user does, and ``extra_extensions`` copied there."""
        self.prepare_models(tiny_models)
        self.install_extensions(extra_extensions)

    def prepare_models(self, tiny_models: bool = True) -> None:
        """The tier's tiny checkpoints, LoRAs and VAE in the data folder's models/, made by the WebUI's own
        LDM classes (``make_models.py``); nothing unless ``tiny_models``."""
        models = self.data_dir / "models"
        if tiny_models and not (models / "Stable-diffusion" / CHECKPOINT_B).is_file():
            snapshot = next(
                (self.testbed / "hf-home" / "hub").glob("models--openai--clip-vit-large-patch14/snapshots/*")
            )
            subprocess.run(
                [
                    str(self.python),
                    str(Path(__file__).with_name("make_models.py")),
                    str(self.webui),
                    str(self.data_dir),
                    str(snapshot),
                ],
                cwd=self.webui,
                env=self.env(),
                check=True,
                capture_output=True,
                text=True,
            )

    def install_extensions(self, extra_extensions: list[Path]) -> None:
        """The extension cloned into extensions/ as a user does (or copied from the work tree, uncommitted
        files too, with ``OV_REAL_WEBUI_SOURCE=worktree``), and ``extra_extensions`` copied there."""
        extensions = self.data_dir / "extensions"
        extensions.mkdir(parents=True, exist_ok=True)
        target = extensions / EXTENSION_NAME
        if target.exists():
            shutil.rmtree(target)
        if os.environ.get("OV_REAL_WEBUI_SOURCE") == "worktree":  # while developing: uncommitted files too
            files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout.splitlines()
            for name in files:
                if (ROOT / name).is_file():
                    (target / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ROOT / name, target / name)
        else:  # as a user installs it
            subprocess.run(["git", "clone", "-q", str(ROOT), str(target)], check=True)
        for folder in extra_extensions:
            shutil.copytree(folder, extensions / folder.name, dirs_exist_ok=True)

    def run_installer(self, extension: str = EXTENSION_NAME) -> str:
        """Runs an extension's ``install.py`` as the WebUI does at start (its root on ``PYTHONPATH``), for a
        WebUI started with ``--skip-install``; returns its output."""
        env = dict(self.env(), PYTHONPATH=str(self.webui))
        done = subprocess.run([str(self.python), str(self.data_dir / "extensions" / extension / "install.py")],
                              cwd=self.webui, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{extension}/install.py exited with {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout + done.stderr

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYTEST"))}
        venv = self.testbed / "venv"
        env.update(
            PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
            VIRTUAL_ENV=str(venv),
            REQS_FILE=str(self.testbed / self.requirements_file),
            LD_LIBRARY_PATH=str(self.testbed / "tvstub"),
            HF_HOME=str(self.testbed / "hf-home"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            DO_NOT_TRACK="1",
            GRADIO_ANALYTICS_ENABLED="False",
            PYTHONUNBUFFERED="1",  # start() reads the log while the WebUI runs
        )
        return env

    # --- process -----------------------------------------------------------------------------------
    def start(self, timeout: float = 900) -> None:
        self.port = free_port()
        self.starts += 1
        self.log_path = self.log_dir / f"{self.name.lower()}-{self.starts}.log"
        cmd = [
            str(self.python),
            "launch.py",
            *self.launch_flags,
            *self.extra_flags,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--ckpt",
            str(self.data_dir / "models" / "Stable-diffusion" / self.checkpoint),
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                cmd, cwd=self.webui, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        t0 = time.time()
        # No request before the WebUI says it has started: its server answers while webui.py still adds
        # the API's middleware, and a request in that window makes starlette refuse it ("Cannot add
        # middleware after an application has started"), which kills the WebUI.
        while self.started_marker not in self.log_text():
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.time() - t0 > timeout:
                raise RuntimeError(f"the {self.name} did not start in {timeout} s:\n{self.log_tail()}")
            time.sleep(0.5)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/sdapi/v1/sd-models", timeout=10):
                    self.start_seconds = time.time() - t0
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.time() - t0 > timeout:
                    raise RuntimeError(f"the {self.name} did not answer in {timeout} s:\n{self.log_tail()}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.process = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # --- HTTP ----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, path: str, payload: Any = None, timeout: float = 1800, method: str | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} -> HTTP {exc.code}: {exc.read()[:2000]!r}\n{self.log_tail()}") from exc
        return json.loads(body) if body else None

    def get(self, path: str, timeout: float = 60) -> Any:
        return self.call(path, timeout=timeout)

    def generate(self, payload: dict[str, Any], kind: str = "txt2img") -> Result:
        t0 = time.time()
        response = self.call(f"/sdapi/v1/{kind}", payload)
        seconds = time.time() - t0
        return Result([decode_image(b) for b in response["images"]], json.loads(response["info"]), seconds)

    def record(self, what: str, psnr_db: float, run: Result | None = None) -> None:
        """Note a measured PSNR (and the accelerated run's time, compiles and cache hits) in
        ``<log dir>/psnr.tsv``: the numbers the README and closing notes quote."""
        extra = ""
        if run is not None and run.status:
            st = run.status
            extra = (f"\t{run.seconds:.1f} s\tcompiles {st.get('compiles')}"
                     f"\tcompile {st.get('compile_seconds', 0):.1f} s\tcache hits {st.get('cache_hits')}")
        with open(self.log_dir / "psnr.tsv", "a") as f:
            f.write(f"{what}\t{psnr_db:.1f}{extra}\n")

    def weight_file_pages(self) -> tuple[int, int]:
        """(bytes mapped, bytes of them in the WebUI's memory) of the extension's weight files (named
        ``.ov-weights-*``), read from the WebUI process's ``/proc/<pid>/smaps``: a reading of its own, apart
        from the extension's status."""
        assert self.process is not None
        size = rss = 0
        inside = False
        with open(f"/proc/{self.process.pid}/smaps", encoding="utf-8") as f:
            for line in f:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = ".ov-weights-" in line
                elif inside and line.startswith("Size:"):
                    size += int(line.split()[1]) * 1024
                elif inside and line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
        return size, rss

    def status(self) -> dict[str, Any]:
        """The extension's report of its last run (``GET /openvino-accelerate/v1/status``), with the WebUI's
        weight file pages as :meth:`weight_file_pages` reads them now (``"weight_file_pages"``: a stock
        generation after it reads PyTorch's weights back)."""
        status = self.get("/openvino-accelerate/v1/status")
        if isinstance(status, dict) and self.process is not None:
            status["weight_file_pages"] = list(self.weight_file_pages())
        return status
