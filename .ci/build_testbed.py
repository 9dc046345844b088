"""Builds the real-WebUI test bed: AUTOMATIC1111 WebUI v1.10.1, CPU only, offline, for tests/real_webui.

Usage (``bash .ci/testbed`` runs it with the defaults below; any python3 >= 3.9 runs this file)::

    A1111_ROOT=build/a1111-testbed [A1111_SRC=<webui-v1.10.1 .tar.gz | folder>] python3 .ci/build_testbed.py

What ends up in ``$A1111_ROOT`` (what tests/real_webui/webui.py and ``python -m bench webui`` use):

  webui/          the WebUI at v1.10.1, with repositories/ at the commits its launch_utils.py pins, each
                  with a .git whose HEAD is that commit (the WebUI's git_clone() then does nothing),
                  a full-size random SD 1.5 checkpoint in models/Stable-diffusion (for the bench and
                  the ControlNet tests; the bench adds a second with this script's worker when it needs
                  it) and a random ControlNet for it in models/ControlNet
  sd-webui-controlnet/   the ControlNet extension at 56cec5b2 (just after v1.1.455), never in the WebUI's
                  extensions/: the tests that need it copy it into their own data folder and start the
                  WebUI with --skip-install (its install.py would move pins and reach GitHub); its
                  controlnet_aux is in the venv, installed with every other package pinned
  venv/           the WebUI's Python (3.10 or 3.11): torch 2.13.0+cpu, torchvision 0.28.0 and every pin of
                  requirements_versions.txt unmoved (setuptools aside, see SETUPTOOLS), openai-clip
  tvstub/         stand-ins for the CUDA libraries the PyPI torchvision wheel links (LD_LIBRARY_PATH)
  hf-home/        a Hugging Face cache with the tokenizer and config of openai/clip-vit-large-patch14,
                  written by transformers from openai-clip's tokenizer tables, offline (HF_HOME)
  requirements-a1111-py311.txt   the requirements the WebUI checks at start (REQS_FILE)
  constraints.txt                the pins every install here runs under (nothing moves torch)

Where the WebUI comes from:
  * ``A1111_SRC`` set: that archive (any tar, e.g. the ``.tar.gz`` CI uses) or folder. A source without
    ``repositories/`` (GitHub's own release archive) gets them from git, as below.
  * otherwise: git, https://github.com/AUTOMATIC1111/stable-diffusion-webui at 82a973c0 (tag v1.10.1),
    and each repository from the URL and commit ``modules/launch_utils.py`` names, honouring the same
    environment overrides the WebUI does (``STABLE_DIFFUSION_REPO``, ``K_DIFFUSION_COMMIT_HASH``, ...).
    Stability-AI deleted its stablediffusion repository in December 2025; like the WebUI's maintainers
    (AUTOMATIC1111/stable-diffusion-webui#17213) it is fetched from the w-e-w/stablediffusion fork.
  * ControlNet: ``CONTROLNET_SRC`` (a tar archive or folder; ``.ci/testbed`` uses the workplace's
    ``sd-webui-controlnet-56cec5b2.tar.gz`` beside the WebUI's archive when it exists), otherwise git,
    https://github.com/Mikubill/sd-webui-controlnet at 56cec5b2.
Packages come from the configured package index; torch's CPU wheel from ``$A1111_WHEELS`` (default
/opt/wheels) when a matching wheel is there, else from ``$TORCH_INDEX_URL`` (PyTorch's CPU index).
``A1111_PYTHON`` names the interpreter for the venv (default python3.11).

Every step first checks whether its result is there (a built bed is checked in under a minute); the
last one runs the WebUI's own preparation (``launch.py --exit``) with pip given no index and git allowed
local repositories only, so a bed that would install or fetch anything at start fails here. Start over
with ``rm -rf "$A1111_ROOT"``. The bed must not lie under a folder whose name starts with a dot (the
WebUI's gradio refuses to serve files from there).

Exit status: 0 built and checked; 1 a build step failed; 75 no ``A1111_SRC`` and the WebUI's git
repository cannot be reached (nothing was built; ``.ci/testbed`` turns this into a warning).

The same file also runs inside the bed's venv (``venv/bin/python build_testbed.py worker ...``) for the
steps that need torch, transformers or the WebUI's LDM code; those imports happen only there.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WEBUI_REPO = "https://github.com/AUTOMATIC1111/stable-diffusion-webui.git"
WEBUI_COMMIT = "82a973c04367123ae98bd9abdf80d9eda9b910e2"
WEBUI_VERSION = "1.10.1"
TORCH = "2.13.0"
TORCHVISION = "0.28.0"  # the torchvision release made with torch 2.13
# The one pin of requirements_versions.txt that cannot stay: it says setuptools==69.5.1, torch 2.13 requires
# setuptools>=77.0.3, and setuptools 81 drops pkg_resources, which openai-clip's setup.py imports.
SETUPTOOLS = "80.9.0"
OPENAI_CLIP = "1.0.1"  # PyPI's packaging of openai/CLIP (the WebUI would pip-install a GitHub zip of it)
CLIP_MODEL = "openai/clip-vit-large-patch14"
# name -> torch seed; the recipe (seeds, re-initialised layers, fp16) keeps them identical to earlier beds
CHECKPOINTS = {"sd15-random.safetensors": 1}
# the bench's second one (its checkpoint switch): made by bench/webui.py with this script's worker on first use,
# not by every CI run (51 s on a 2-core Zen 3)
BENCH_CHECKPOINTS = {"sd15-random-b.safetensors": 2}
# the recipe of these random checkpoints, shared with the real-WebUI tier's tiny ones (a plain script, no pytest)
MODEL_RECIPE = "tests/real_webui/make_models.py"
CONTROLNET_REPO = "https://github.com/Mikubill/sd-webui-controlnet.git"
CONTROLNET_COMMIT = "56cec5b2958edf3b1807b7e7b2b1b5186dbd2f81"  # just after v1.1.455
CONTROLNET_VERSION = "v1.1.455"  # its scripts/controlnet_version.py at that commit
CONTROLNET_AUX = "0.0.10"  # what its preprocessors import; installs beside the WebUI's pins
CONTROLNET_FOLDER = "sd-webui-controlnet"
# the random ControlNet, made from the first full-size checkpoint's UNet by the tier's recipe
CONTROLNET_MODEL = "ovtest-controlnet-sd15.safetensors"
CONTROLNET_RECIPE = "tests/real_webui/make_controlnet.py"
# repositories gone from the URL the WebUI v1.10.1 names, and where their pinned commit lives now
MOVED_REPOSITORIES = {
    "https://github.com/Stability-AI/stablediffusion.git": "https://github.com/w-e-w/stablediffusion.git",
}
REQUIREMENTS = "requirements-a1111-py311.txt"
SOURCE_UNAVAILABLE = 75  # EX_TEMPFAIL

STARTED = time.monotonic()


@dataclass(frozen=True)
class Source:
    """A source tree the bed needs: where it comes from and how it is recognised."""

    variable: str
    """The environment variable that may name a local folder or tar archive of it."""
    label: str
    """Its name in the build's log and errors."""
    marker: str
    """A file at the top of the tree."""
    repo: str
    commit: str
    version: str
    check: Callable[[Path], None]
    """Raises BuildError unless the tree at the given folder is the version the bed needs."""
    ignore: tuple[str, ...] = ("__pycache__",)
    """Names left out when a folder is copied."""
    needs_reachable: bool = False
    """Without the variable and with the repository unreachable, SourceUnavailable (the tier skips) rather
    than a failed fetch."""


class BuildError(Exception):
    """A step failed: the bed is not usable."""


class SourceUnavailable(Exception):
    """No WebUI source was given and its git repository cannot be reached."""


def say(message: str) -> None:
    sys.stdout.write(f"[testbed {time.monotonic() - STARTED:5.0f}s] {message}\n")
    sys.stdout.flush()


def run(cmd: list, *, cwd: Path | None = None, env: dict | None = None, capture: bool = False,
        timeout: float | None = None) -> str:
    """Runs ``cmd``; its output goes to ours unless captured. A non-zero exit raises BuildError."""
    cmd = [str(part) for part in cmd]
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, text=True, timeout=timeout,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.STDOUT if capture else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{' '.join(cmd)}: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stdout or "").splitlines()[-40:])
        raise BuildError(f"{' '.join(cmd)} exited with {done.returncode}" + (f":\n{tail}" if tail else ""))
    return done.stdout or ""


def write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------------------ git
def git(*args: object, capture: bool = True, timeout: float | None = None) -> str:
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")  # a missing repository fails instead of asking for a login
    return run(["git", *args], env=env, capture=capture, timeout=timeout).strip()


def git_head(folder: Path) -> str | None:
    """HEAD of the repository whose .git is in ``folder`` itself (never one of its parents)."""
    if not (folder / ".git").exists():
        return None
    try:
        return git("-C", folder, "rev-parse", "HEAD")
    except BuildError:
        return None


def extract_all(archive: tarfile.TarFile, dest: Path) -> None:
    """Unpack ``archive`` into ``dest`` with tarfile's "data" filter where this Python has it."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(dest, filter="data")
    else:  # Python < 3.11.4
        archive.extractall(dest)


def reachable(url: str) -> bool:
    try:
        git("ls-remote", "--exit-code", url, "HEAD", timeout=120)
        return True
    except BuildError:
        return False


def git_fetch_commit(url: str, commit: str, dest: Path) -> None:
    """A checkout of ``commit`` (detached, as the WebUI's own git_clone leaves it) with ``url`` as origin."""
    dest.mkdir(parents=True)
    git("init", "-q", dest)
    git("-C", dest, "remote", "add", "origin", url)
    try:  # GitHub serves a single commit by its hash: no history needed
        git("-C", dest, "fetch", "-q", "--depth", "1", "origin", commit, capture=False)
    except BuildError:
        git("-C", dest, "fetch", "-q", "origin", capture=False)
    git("-C", dest, "-c", "advice.detachedHead=false", "checkout", "-q", commit, capture=False)
    if git_head(dest) != commit:
        raise BuildError(f"{dest}: HEAD is not {commit} after the checkout")


def record_head(dest: Path, url: str, commit: str) -> None:
    """For code that came without its history (a source archive): a .git with ``commit`` as detached HEAD,
    which is all the WebUI reads (``git rev-parse HEAD``) before it would fetch."""
    git("init", "-q", dest)
    if not git("-C", dest, "remote"):
        git("-C", dest, "remote", "add", "origin", url)
    (dest / ".git" / "HEAD").write_text(commit + "\n", encoding="ascii")


# ------------------------------------------------------------------------------------------ the bed
@dataclass(frozen=True)
class Pin:
    name: str  # folder under repositories/
    label: str
    url: str
    commit: str
    url_overridden: bool


class TestBed:
    """The A1111 bed; ``.ci/forge_testbed.py`` builds Forge's with a subclass (its venv, torch and tvstub steps)."""

    label = "the WebUI v1.10.1"
    """What the venv is for, in errors."""
    python_variable = "A1111_PYTHON"
    """The environment variable that names the venv's interpreter (default python3.11)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.webui = root / "webui"
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.requirements = root / REQUIREMENTS
        self.constraints = root / "constraints.txt"
        self.tvstub = root / "tvstub"
        self.hf_home = root / "hf-home"
        self.hf_model = self.hf_home / "hub" / f"models--{CLIP_MODEL.replace('/', '--')}"
        self.controlnet = root / CONTROLNET_FOLDER

    # --- running things in the venv ---------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment the tests start the WebUI with (tests/real_webui/webui.py), for every venv run."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(
            PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            VIRTUAL_ENV=str(self.venv),
            LD_LIBRARY_PATH=str(self.tvstub),
            HF_HOME=str(self.hf_home),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def py(self, *args: object, capture: bool = False, cwd: Path | None = None, **env: str) -> str:
        return run([self.python, *args], env=self.env(**env), capture=capture, cwd=cwd)

    def worker(self, *args: object, cwd: Path | None = None) -> str:
        # the libraries' deprecation warnings say nothing about the bed; failures still print in full
        return self.py(Path(__file__).resolve(), "worker", *args, cwd=cwd, PYTHONWARNINGS="ignore")

    def succeeds(self, *args: object, cwd: Path | None = None) -> bool:
        try:
            self.py(*args, capture=True, cwd=cwd)
            return True
        except BuildError:
            return False

    def pip_install(self, *args: object) -> None:
        self.py("-m", "pip", "install", "--disable-pip-version-check", "--quiet", *args)

    def versions(self, *names: str) -> dict[str, str | None]:
        return json.loads(self.py(Path(__file__).resolve(), "worker", "versions", *names, capture=True))

    def freeze(self) -> dict[str, str]:
        """{normalized name: version} of every distribution in the venv."""
        return json.loads(self.py(Path(__file__).resolve(), "worker", "freeze", capture=True))

    # --- 1. the WebUI's source ---------------------------------------------------------------------
    def webui_source(self) -> None:
        self.stage(Source("A1111_SRC", "WebUI source", "launch.py", WEBUI_REPO, WEBUI_COMMIT, f"v{WEBUI_VERSION}",
                          check_webui_version, ignore=("venv", "__pycache__"), needs_reachable=True), self.webui)

    def stage(self, source: Source, dest: Path) -> None:
        """Puts ``source``'s tree at ``dest``: from the folder or archive its variable names, else from git at
        its commit; checked (its marker file at the top, its version) before it is renamed into place."""
        if (dest / source.marker).is_file():
            source.check(dest)
            return
        staging = dest.with_name(dest.name + ".part")
        shutil.rmtree(staging, ignore_errors=True)
        given = os.environ.get(source.variable, "")
        if given:
            path = Path(given).expanduser()
            if path.is_dir():
                say(f"{source.label}: copying the folder {path}")
                shutil.copytree(path, staging, symlinks=True, ignore=shutil.ignore_patterns(*source.ignore))
            elif path.is_file():
                say(f"{source.label}: unpacking {path}")
                staging.mkdir()
                with tarfile.open(path) as archive:
                    commit = archive.pax_headers.get("comment", "")  # git archive records its commit there
                    if commit and len(commit) == 40 and commit != source.commit:
                        raise BuildError(f"{source.variable}={given} is commit {commit}, not {source.commit}")
                    extract_all(archive, staging)
            else:
                raise BuildError(f"{source.variable}={given}: no such file or folder")
        else:
            if source.needs_reachable and not reachable(source.repo):
                raise SourceUnavailable(f"{source.variable} is not set and {source.repo} cannot be reached")
            say(f"{source.label}: git, {source.repo} at {source.commit[:8]} ({source.version})")
            git_fetch_commit(source.repo, source.commit, staging)
        top = staging if (staging / source.marker).is_file() else None
        if top is None:  # archives hold one folder (stable-diffusion-webui-1.10.1/, sd-webui-controlnet/)
            children = [p for p in staging.iterdir() if p.is_dir()]
            if len(children) == 1 and (children[0] / source.marker).is_file():
                top = children[0]
        if top is None:
            raise BuildError(f"{given or source.repo}: no {source.marker} at its top or in its only folder; "
                             f"not a {source.label}")
        source.check(top)
        top.rename(dest)
        shutil.rmtree(staging, ignore_errors=True)

    # --- 2. repositories/ --------------------------------------------------------------------------
    def repositories(self) -> None:
        for pin in pinned_repositories(self.webui / "modules" / "launch_utils.py"):
            dest = self.webui / "repositories" / pin.name
            head = git_head(dest)
            if head is None and dest.is_dir() and any(dest.iterdir()):
                say(f"repositories/{pin.name}: code without history; recording HEAD {pin.commit[:8]}")
                record_head(dest, pin.url, pin.commit)
                head = git_head(dest)
            elif head is None:
                url = pin.url if pin.url_overridden else MOVED_REPOSITORIES.get(pin.url, pin.url)
                say(f"repositories/{pin.name}: git, {url} at {pin.commit[:8]}")
                staging = dest.with_name(pin.name + ".part")
                shutil.rmtree(staging, ignore_errors=True)
                git_fetch_commit(url, pin.commit, staging)
                if dest.is_dir():
                    dest.rmdir()
                staging.rename(dest)
                head = git_head(dest)
            if head != pin.commit:
                raise BuildError(f"{dest} is at {head}, but the WebUI pins {pin.label} to {pin.commit} "
                                 f"(remove the folder to fetch it again)")

    # --- 3. requirements file ----------------------------------------------------------------------
    def requirements_file(self) -> None:
        text = (self.webui / "requirements_versions.txt").read_text(encoding="utf-8")
        text, count = re.subn(r"(?m)^setuptools==.*$",
                              f"setuptools=={SETUPTOOLS}  # test bed: torch {TORCH} needs >=77.0.3", text)
        if count != 1:
            raise BuildError("requirements_versions.txt: no setuptools pin to replace")
        write_if_changed(self.requirements, text)

    # --- 4. venv, torch, torchvision ---------------------------------------------------------------
    def python_and_torch(self) -> None:
        if not self.python.is_file():
            base = os.environ.get(self.python_variable, "python3.11")
            say(f"venv with {base}")
            run([base, "-m", "venv", self.venv])
        tag = self.py("-c", "import sys; print('%d%d' % sys.version_info[:2])", capture=True).strip()
        if tag not in ("310", "311"):
            raise BuildError(f"the venv's Python is {tag[0]}.{tag[1:]}; {self.label} needs 3.10 or 3.11 "
                             f"(set {self.python_variable} and remove venv/)")
        have = self.versions("torch", "torchvision")
        if have["torch"] != f"{TORCH}+cpu":
            wheel_folder = Path(os.environ.get("A1111_WHEELS", "/opt/wheels"))
            wheels = sorted(wheel_folder.glob(f"torch-{TORCH}+cpu-cp{tag}-*.whl"))
            if wheels:
                say(f"torch {TORCH} (CPU) from {wheels[-1]}")
                spec = [wheels[-1]]
            else:
                index = os.environ.get("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
                say(f"torch {TORCH} (CPU) from {index}")
                spec = [f"torch=={TORCH}+cpu", "--extra-index-url", index]
            self.pip_install(f"setuptools=={SETUPTOOLS}", "wheel", *spec)
            have = self.versions("torch", "torchvision")
        if not self.succeeds("-c", "import sys, torch; sys.exit(torch.version.cuda is not None)"):
            raise BuildError(f"torch {have['torch']} in the venv is not a CPU build")
        write_if_changed(self.constraints, f"torch=={have['torch']}\ntorchvision=={TORCHVISION}\n"
                                           f"setuptools=={SETUPTOOLS}\n")
        if have["torchvision"] != TORCHVISION:
            # PyPI's wheel (built against CUDA torch; step 5 covers what it links); --no-deps keeps torch
            say(f"torchvision {TORCHVISION}")
            self.pip_install("--no-deps", f"torchvision=={TORCHVISION}")

    # --- 5. stand-ins for the CUDA libraries torchvision links ---------------------------------------
    def torchvision_stubs(self) -> None:
        self.tvstub.mkdir(exist_ok=True)
        check = Path(__file__).resolve(), "worker", "torchvision-loads"
        if self.succeeds(*check):
            return
        say("tvstub/: stand-ins for the CUDA libraries torchvision's extensions link")
        for old in self.tvstub.iterdir():
            old.unlink()
        paths = json.loads(self.py("-c", "import importlib.util as u, json, os\n"
                                         "t = u.find_spec('torch').submodule_search_locations[0]\n"
                                         "v = u.find_spec('torchvision').submodule_search_locations[0]\n"
                                         "print(json.dumps([os.path.join(t, 'lib'), v]))", capture=True))
        torch_lib, torchvision_dir = Path(paths[0]), Path(paths[1])
        made = build_stub_libraries(sorted(torchvision_dir.glob("*.so")), torch_lib, self.tvstub)
        say(f"  {made}")
        if not self.succeeds(*check):
            self.py(*check)  # again, for its error
            raise BuildError("torchvision does not load with the stand-ins in tvstub/")

    # --- 6. the WebUI's requirements -----------------------------------------------------------------
    def requirements_met(self) -> bool:
        """The WebUI's own check (launch_utils.requirements_met): when it passes, launch.py installs nothing."""
        code = ("import sys\nfrom modules.launch_utils import requirements_met\n"
                "sys.exit(0 if requirements_met(sys.argv[1]) else 1)")
        return self.succeeds("-c", code, self.requirements, cwd=self.webui)

    def webui_requirements(self) -> None:
        installed = False
        if not self.requirements_met():
            say(f"the WebUI's requirements ({self.requirements.name}) under {self.constraints.name}")
            self.pip_install("--prefer-binary", "-r", self.requirements, "-c", self.constraints)
            installed = True
        if not self.succeeds("-c", "import clip"):
            # the WebUI would pip-install a GitHub zip of openai/CLIP at start; its setup.py needs pkg_resources
            say(f"openai-clip {OPENAI_CLIP}")
            self.pip_install("--no-build-isolation", "--prefer-binary", f"openai-clip=={OPENAI_CLIP}",
                             "-c", self.constraints)
            installed = True
        if installed:
            self.check_installed("the WebUI's requirements")
        self.worker("torchvision-works")

    def check_installed(self, what: str) -> None:
        """After an install: the requirements are met (else a BuildError naming ``what`` and the key versions), and
        what ``pip check`` reports, as a warning."""
        if not self.requirements_met():
            have = self.versions("torch", "torchvision", "setuptools", "numpy", "transformers", "gradio")
            raise BuildError(f"{what} are not met after installing them: {have}")
        try:
            self.py("-m", "pip", "check", capture=True)
        except BuildError as e:
            say(f"WARNING: pip check reports conflicts among the installed packages: {e}")

    # --- 7. offline Hugging Face cache ---------------------------------------------------------------
    def hf_cache(self) -> None:
        snapshots = self.hf_model / "snapshots"
        ref = self.hf_model / "refs" / "main"
        # without it transformers 4.30 says, whenever it is imported offline, that the cache needs migrating
        (self.hf_home / "hub").mkdir(parents=True, exist_ok=True)
        write_if_changed(self.hf_home / "hub" / "version.txt", "1")
        if not (ref.is_file() and (snapshots / ref.read_text().strip() / "vocab.json").is_file()):
            say(f"hf-home/: tokenizer and config of {CLIP_MODEL}, made offline")
            staging = self.hf_model / "staging"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            self.worker("hf-files", staging)
            # the snapshot is named by a hash of its files, so the same files always make the same cache
            digest = hashlib.sha1()
            for file in sorted(staging.iterdir()):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
            snapshot = snapshots / digest.hexdigest()
            shutil.rmtree(snapshot, ignore_errors=True)
            snapshots.mkdir(exist_ok=True)
            staging.rename(snapshot)
            ref.parent.mkdir(exist_ok=True)
            ref.write_text(snapshot.name)
        self.worker("hf-check")

    # --- 8. full-size random checkpoints -------------------------------------------------------------
    def checkpoints(self) -> None:
        folder = self.webui / "models" / "Stable-diffusion"
        folder.mkdir(parents=True, exist_ok=True)
        for name, seed in CHECKPOINTS.items():
            if not (folder / name).is_file():
                say(f"models/Stable-diffusion/{name}: random SD 1.5 weights (seed {seed}, fp16)")
                self.worker("checkpoint", folder / name, seed, cwd=self.webui)

    # --- 9. sd-webui-controlnet and its controlnet_aux ----------------------------------------------------
    def controlnet_source(self) -> None:
        self.stage(Source("CONTROLNET_SRC", "sd-webui-controlnet source", "scripts/controlnet.py", CONTROLNET_REPO,
                          CONTROLNET_COMMIT, CONTROLNET_VERSION, check_controlnet_version), self.controlnet)

    def controlnet_aux(self) -> None:
        """controlnet_aux under constraints of every installed distribution's version: pip may add packages,
        never move one; the venv's distributions are compared before and after to be sure."""
        if self.versions("controlnet_aux")["controlnet_aux"] == CONTROLNET_AUX:
            return
        say(f"controlnet_aux {CONTROLNET_AUX}, every installed package as a constraint")
        before = self.freeze()
        pinned = self.root / "constraints-controlnet.txt"
        pinned.write_text("".join(f"{name}=={version}\n" for name, version in sorted(before.items())
                                  if name != "controlnet-aux"), encoding="utf-8")
        self.pip_install("--prefer-binary", f"controlnet_aux=={CONTROLNET_AUX}", "-c", pinned)
        after = self.freeze()
        moved = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
        if moved:
            raise BuildError(f"installing controlnet_aux moved packages of the venv: {moved}")
        say(f"  added: {', '.join(f'{n} {v}' for n, v in sorted(after.items()) if n not in before)}")
        if not self.succeeds("-c", "import cv2, controlnet_aux"):
            self.py("-c", "import cv2, controlnet_aux")  # again, for its error
            raise BuildError("controlnet_aux does not import")

    # --- 10. a random ControlNet for the full-size SD 1.5 checkpoint ---------------------------------------
    def controlnet_model(self) -> None:
        out = self.webui / "models" / "ControlNet" / CONTROLNET_MODEL
        if out.is_file():
            return
        checkpoint = self.webui / "models" / "Stable-diffusion" / next(iter(CHECKPOINTS))
        say(f"models/ControlNet/{CONTROLNET_MODEL}: random ControlNet from {checkpoint.name}'s UNet (fp16)")
        # LDM's classes print a line per layer they build; the recipe's own report is its last line (the whole
        # output comes with the error when it fails)
        report = self.py(Path(__file__).resolve().parents[1] / CONTROLNET_RECIPE, self.webui, self.controlnet,
                         checkpoint, out, capture=True, cwd=self.webui, PYTHONWARNINGS="ignore")
        say("  " + next((line for line in reversed(report.splitlines()) if line.startswith("ControlNet (seed")), ""))

    # --- 11. the WebUI's own preparation, offline -----------------------------------------------------
    def offline_start_check(self) -> None:
        """``launch.py --exit`` runs the WebUI's prepare_environment() (repositories, requirements, clip,
        open_clip, torch) and exits. pip and git cannot reach any network here, so anything it would
        fetch or install fails the build instead of slipping into the bed."""
        with tempfile.TemporaryDirectory(prefix="testbed-check-") as data:
            try:
                out = self.py(
                    "launch.py", "--exit", "--skip-torch-cuda-test", "--skip-version-check", "--data-dir", data,
                    capture=True, cwd=self.webui,
                    REQS_FILE=str(self.requirements), PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1",
                    GIT_ALLOW_PROTOCOL="file", GIT_TERMINAL_PROMPT="0",
                )
            except BuildError as e:
                raise BuildError(f"the WebUI's own start-up preparation fails offline: {e}") from e
        acted = [line for line in out.splitlines() if line.startswith(("Installing", "Cloning", "Fetching"))]
        if acted:
            raise BuildError("the WebUI would install or fetch at start:\n" + "\n".join(acted))

    def build(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.webui_source()
        self.repositories()
        self.requirements_file()
        self.python_and_torch()
        self.torchvision_stubs()
        self.webui_requirements()
        self.hf_cache()
        self.checkpoints()
        self.controlnet_source()
        self.controlnet_aux()
        self.controlnet_model()
        self.offline_start_check()


def check_webui_version(folder: Path) -> None:
    changelog = folder / "CHANGELOG.md"
    first = re.search(r"(?m)^## (\S+)", changelog.read_text(encoding="utf-8")) if changelog.is_file() else None
    version = first.group(1) if first else "unknown"
    if version != WEBUI_VERSION:
        raise BuildError(f"{folder} is WebUI {version} (its CHANGELOG.md), not v{WEBUI_VERSION}")
    head = git_head(folder)
    if head is not None and head != WEBUI_COMMIT:
        raise BuildError(f"{folder} is a git checkout at {head}, not v{WEBUI_VERSION} ({WEBUI_COMMIT})")


def check_controlnet_version(folder: Path) -> None:
    version_file = folder / "scripts" / "controlnet_version.py"
    text = version_file.read_text(encoding="utf-8") if version_file.is_file() else ""
    found = re.search(r"version_flag = '([^']+)'", text)
    version = found.group(1) if found else "unknown"
    if version != CONTROLNET_VERSION:
        raise BuildError(f"{folder} is sd-webui-controlnet {version} (its scripts/controlnet_version.py), "
                         f"not {CONTROLNET_VERSION} (remove it to unpack or fetch {CONTROLNET_COMMIT[:8]})")
    head = git_head(folder)
    if head is not None and head != CONTROLNET_COMMIT:
        raise BuildError(f"{folder} is a git checkout at {head}, not {CONTROLNET_COMMIT}")


def pinned_repositories(launch_utils: Path) -> list[Pin]:
    """The ``git_clone(url, repo_dir(name), label, commit)`` calls of the WebUI's prepare_environment(),
    with url and commit resolved as the WebUI resolves them: ``os.environ.get(NAME, default)``."""
    tree = ast.parse(launch_utils.read_text(encoding="utf-8"))
    prepare = next((node for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef) and node.name == "prepare_environment"), None)
    if prepare is None:
        raise BuildError(f"{launch_utils}: no prepare_environment()")
    settings: dict[str, tuple[str, str]] = {}  # variable -> (environment variable, default)
    for node in ast.walk(prepare):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "os.environ.get"
                and len(node.value.args) == 2 and all(isinstance(a, ast.Constant) for a in node.value.args)):
            settings[node.targets[0].id] = (node.value.args[0].value, node.value.args[1].value)
    pins = []
    for node in ast.walk(prepare):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "git_clone"):
            continue
        url_var, folder, label, commit_var = node.args
        url_env, url_default = settings[url_var.id]
        commit_env, commit_default = settings[commit_var.id]
        commit = os.environ.get(commit_env, commit_default)
        if not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise BuildError(f"{launch_utils}: {commit_env}={commit!r} is not a commit hash")
        pins.append(Pin(name=folder.args[0].value, label=label.value, url=os.environ.get(url_env, url_default),
                        commit=commit, url_overridden=url_env in os.environ))
    if not pins:
        raise BuildError(f"{launch_utils}: no git_clone() calls found in prepare_environment()")
    return pins


@dataclass(frozen=True)
class Symbol:
    name: str
    version: str  # "" when unversioned
    kind: str  # FUNC, OBJECT, TLS, NOTYPE
    binding: str  # GLOBAL, WEAK, ...
    defined: bool


def dynamic_symbols(library: Path) -> list[Symbol]:
    """The dynamic symbols of ``library`` (``readelf --dyn-syms``)."""
    symbols = []
    for line in run(["readelf", "--dyn-syms", "--wide", library], capture=True).splitlines():
        fields = line.split()  # Num: Value Size Type Bind Vis Ndx Name[@[@]version] [(index)]
        if len(fields) < 8 or not fields[0].endswith(":") or not fields[0][:-1].isdigit():
            continue
        name, _, version = fields[7].partition("@")
        symbols.append(Symbol(name, version.lstrip("@"), fields[3], fields[4], fields[6] != "UND"))
    return symbols


def needed_versions(library: Path) -> dict[str, str]:
    """{symbol version: the library file it is required from} (``readelf -V``, its version-needs part)."""
    versions, file, in_needs = {}, "", False
    for line in run(["readelf", "--version-info", "--wide", library], capture=True).splitlines():
        if line.startswith("Version"):
            in_needs = line.startswith("Version needs")
        elif in_needs and (found := re.search(r"File: (\S+)", line)):
            file = found.group(1)
        elif in_needs and (found := re.search(r"Name: (\S+)", line)):
            versions[found.group(1)] = file
    return versions


def build_stub_libraries(extensions: list[Path], torch_lib: Path, out: Path,
                         also_missing: tuple[str, ...] = ()) -> str:
    """Shared libraries standing in for the ones ``extensions`` need and this machine lacks (CUDA's): each
    defines the global symbols an extension takes from that library and finds nowhere else in its own
    dependencies, under the symbol version the extension asks for. Functions abort with a message (CUDA
    paths, never taken on the CPU); data objects are zeroed. Python loads torchvision's ``_C.so`` with
    RTLD_NOW, so an undefined symbol of either kind would fail the import. ``also_missing`` treats present
    libraries as absent (to try the stand-ins of a machine without them)."""
    env = dict(os.environ, LD_LIBRARY_PATH=str(torch_lib))
    # library file -> {symbol version ("" for none) -> {name: kind}}
    stubs: dict[str, dict[str, dict[str, str]]] = {}
    for extension in extensions:
        missing, present = set(), []
        for line in run(["ldd", extension], env=env, capture=True).splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>":
                if parts[2] == "not" or parts[0] in also_missing:
                    missing.add(parts[0])
                else:
                    present.append(Path(parts[2]))
            elif parts and parts[0].startswith("/"):  # the dynamic loader itself (it defines __tls_get_addr)
                present.append(Path(parts[0]))
        if not missing:
            continue
        defined: set[tuple[str, str]] = set()
        for library in present:
            for symbol in dynamic_symbols(library):
                if symbol.defined:
                    defined.update({(symbol.name, symbol.version), (symbol.name, "")})
        required_from = needed_versions(extension)
        for library in missing:
            stubs.setdefault(library, {})
        for symbol in dynamic_symbols(extension):
            if symbol.defined or symbol.binding != "GLOBAL" or (symbol.name, symbol.version) in defined:
                continue
            if symbol.version:  # a versioned reference names its library
                if required_from.get(symbol.version) not in missing:
                    raise BuildError(f"{extension.name}: {symbol.name}@{symbol.version} is defined nowhere, "
                                     f"but {required_from.get(symbol.version)} is there")
                stubs[required_from[symbol.version]].setdefault(symbol.version, {})[symbol.name] = symbol.kind
            else:  # which missing library it lives in is not recorded: every stand-in defines it
                for library in missing:
                    stubs[library].setdefault("", {})[symbol.name] = symbol.kind
    if not stubs:
        return "torchvision needs no stand-ins"
    report = []
    for library, by_version in sorted(stubs.items()):
        kinds = {name: kind for names in by_version.values() for name, kind in names.items()}
        source = [
            "#include <stdio.h>",
            "#include <stdlib.h>",
            "static void cuda_only(const char *name) {",
            '    fprintf(stderr, "tvstub: %s called, but this test bed has no CUDA\\n", name);',
            "    abort();",
            "}",
        ]
        for i, (name, kind) in enumerate(sorted(kinds.items())):
            if kind == "FUNC" and name.startswith(("__cudaRegister", "__cudaUnregister")):
                # the CUDA runtime's registration of an object's kernels, run when it loads and unloads:
                # nothing to register without CUDA (0: a null handle, cudaSuccess)
                source.append(f'long stub_fn_{i}(void) __asm__("{name}");')
                source.append(f"long stub_fn_{i}(void) {{ return 0; }}")
            elif kind == "FUNC":
                source.append(f'void stub_fn_{i}(void) __asm__("{name}");')
                source.append(f'void stub_fn_{i}(void) {{ cuda_only("{name}"); }}')
            else:  # data: room for any pointer, atomic or small struct, zeroed
                source.append(f'char stub_obj_{i}[256] __asm__("{name}") __attribute__((aligned(64))) = {{0}};')
        flags = [f"-Wl,-soname,{library}"]
        with tempfile.TemporaryDirectory() as tmp:
            c_file = Path(tmp) / "stub.c"
            c_file.write_text("\n".join(source) + "\n", encoding="utf-8")
            versions = sorted(v for v in by_version if v)
            if versions:  # define the versions the extensions require of this library, as the real one does
                nodes = []
                for i, version in enumerate(versions):  # symbols without a version go to the first node
                    names = sorted(by_version[version]) + (sorted(by_version.get("", {})) if i == 0 else [])
                    nodes.append(f"{version} {{ global: {'; '.join(names)}; {'local: *; ' if i == 0 else ''}}};")
                script = Path(tmp) / "stub.map"
                script.write_text("\n".join(nodes) + "\n", encoding="utf-8")
                flags.append(f"-Wl,--version-script={script}")
            run(["gcc", "-shared", "-fPIC", "-O1", *flags, "-o", out / library, c_file])
        functions = sum(kind == "FUNC" for kind in kinds.values())
        report.append(f"{library} ({functions} functions, {len(kinds) - functions} data objects)")
    return "; ".join(report)

# ------------------------------------------------------------------------------------------ workers
# Run by the bed's Python (``venv/bin/python build_testbed.py worker <name> ...``), with TestBed.env().


def worker_versions(*names: str) -> None:
    """Prints {distribution: installed version or null} as JSON (stdlib only: runs in a fresh venv)."""
    import importlib.metadata

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    sys.stdout.write(json.dumps({name: version(name) for name in names}) + "\n")


def worker_freeze() -> None:
    """Prints {normalized distribution name: version} of every installed distribution as JSON (stdlib only)."""
    import importlib.metadata

    found = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
             for d in importlib.metadata.distributions() if d.metadata["Name"]}
    sys.stdout.write(json.dumps(found, sort_keys=True) + "\n")


def worker_torchvision_loads() -> None:
    import importlib.util

    import torch

    folder = Path(importlib.util.find_spec("torchvision").submodule_search_locations[0])
    for extension in sorted(folder.glob("*.so")):  # with RTLD_NOW: every symbol must resolve
        torch.ops.load_library(str(extension))


def worker_torchvision_works() -> None:
    """torchvision imports (it needs numpy and Pillow: after the requirements) and runs an op of its own."""
    import torch
    import torchvision.ops

    kept = torchvision.ops.nms(torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]]), torch.rand(3), 0.5)
    assert len(kept) == 2, kept


def worker_hf_files(out: str) -> None:
    """The Hugging Face files of CLIP ViT-L/14's tokenizer, from the tables of openai-clip's tokenizer (the
    one OpenAI trained; its token ids are those of the Hub's vocab.json), and the model's config with
    ViT-L/14's sizes. Both written by transformers itself, so they load as the Hub's files do."""
    import clip.simple_tokenizer
    import transformers

    reference = clip.simple_tokenizer.SimpleTokenizer()
    merges = sorted(reference.bpe_ranks, key=reference.bpe_ranks.get)
    assert len(reference.encoder) == 49408 and len(merges) == 48894, (len(reference.encoder), len(merges))
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        with open(vocab_file, "w", encoding="utf-8") as f:
            json.dump(reference.encoder, f, ensure_ascii=False)
        with open(merges_file, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        tokenizer = transformers.CLIPTokenizer(vocab_file, merges_file, model_max_length=77,
                                               name_or_path=CLIP_MODEL)
        tokenizer.save_pretrained(out)
    config = transformers.CLIPConfig(
        text_config={"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                     "num_hidden_layers": 12, "max_position_embeddings": 77, "vocab_size": 49408,
                     "projection_dim": 768, "hidden_act": "quick_gelu"},
        vision_config={"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                       "num_hidden_layers": 24, "image_size": 224, "patch_size": 14, "projection_dim": 768,
                       "hidden_act": "quick_gelu"},
        projection_dim=768,
        architectures=["CLIPModel"],
        torch_dtype="float32",
    )
    config.save_pretrained(out)


def worker_hf_check() -> None:
    """The cache loads offline by the Hub name, and tokenizes as OpenAI's tokenizer does."""
    import clip
    import transformers

    tokenizer = transformers.CLIPTokenizer.from_pretrained(CLIP_MODEL)
    prompts = ["a photo of an astronaut riding a horse on mars", "", "(a red car:1.3), blurry!",
               "Ünïcödé 東京 🙂", "a harbour at dawn, 8k, highly detailed"]
    for prompt in prompts:
        ours = tokenizer(prompt)["input_ids"]
        theirs = [int(i) for i in clip.tokenize(prompt)[0] if i != 0]
        assert ours == theirs, (prompt, ours, theirs)
    ids = tokenizer(prompts[0])["input_ids"]
    assert ids == [49406, 320, 1125, 539, 550, 18376, 6765, 320, 4558, 525, 7496, 49407], ids
    assert tokenizer.model_max_length == 77 and tokenizer.pad_token == "<|endoftext|>"
    text = transformers.CLIPTextConfig.from_pretrained(CLIP_MODEL)
    shape = (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.vocab_size, text.hidden_act)
    assert shape == (768, 12, 12, 49408, "quick_gelu"), shape


def worker_checkpoint(out: str, seed: str) -> None:
    """A random-weight SD 1.5 checkpoint (fp16) made by the WebUI's LDM code from configs/v1-inference.yaml
    (run in webui/), by the real-WebUI tier's own recipe: ``random_ldm_model`` of
    tests/real_webui/make_models.py (LDM's zero-initialised projections re-initialised, the text encoder's
    LayerNorms given random affines, the result checked). A seed always gives the same file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_models", Path(__file__).resolve().parents[1] / MODEL_RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.use_webui_ldm(".")
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    model, _ = recipe.random_ldm_model(OmegaConf.load(os.path.join("configs", "v1-inference.yaml")).model, int(seed))
    state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, out + ".part")
    os.replace(out + ".part", out)


WORKERS = {
    "versions": worker_versions,
    "freeze": worker_freeze,
    "torchvision-loads": worker_torchvision_loads,
    "torchvision-works": worker_torchvision_works,
    "hf-files": worker_hf_files,
    "hf-check": worker_hf_check,
    "checkpoint": worker_checkpoint,
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        WORKERS[argv[1]](*argv[2:])
        return 0
    root = os.environ.get("A1111_ROOT")
    if not root:
        sys.stderr.write("set A1111_ROOT to the folder to build the test bed in (bash .ci/testbed does)\n")
        return 1
    bed = TestBed(Path(root).expanduser().resolve())
    try:
        bed.build()
    except SourceUnavailable as e:
        sys.stderr.write(f"no WebUI source: {e}\n")
        return SOURCE_UNAVAILABLE
    except BuildError as e:
        sys.stderr.write(f"ERROR: the test bed in {bed.root} is not usable: {e}\n")
        return 1
    say(f"test bed ready in {bed.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
