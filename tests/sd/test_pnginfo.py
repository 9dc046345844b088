"""The infotext: hand-worked texts, and the WebUI's own reader (in the test bed) on what we write.

The oracle is A1111's ``modules/infotext_utils.parse_generation_parameters``, run in the test bed's
Python (``A1111_ROOT``, default ``/work/tb/a1111``); skipped when the test bed is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ov_accelerate_sd.pnginfo import format_infotext, parameter_fields, parse_infotext, quote

# (prompt, negative prompt, parameters) as our pipeline writes them, and harder ones.
WRITTEN = [
    ("a cat", "", {"Steps": 20, "Sampler": "Euler a", "CFG scale": 7.0, "Seed": 1, "Size": "512x512"}),
    ("a (cat:1.2), sitting\nsecond line", "blurry, bad", {
        "Steps": 20, "Sampler": "DPM++ 2M", "Schedule type": "Karras", "CFG scale": 7.0, "Seed": 42,
        "Size": "512x768", "Model hash": "01fc8e974a", "Model": "my model", "Denoising strength": 0.75,
        "Clip skip": 2, "OpenVINO": "CPU, UNet+VAE+TE, f32",
    }),
    ("", "", {"Steps": 1, "Seed": 2, "Size": "64x64", "Note": 'has "quotes", commas: and colons\nand a line'}),
    ("émoji 🐈, 猫", "Negative prompt: twice", {
        "Steps": 3, "Seed": 4294967295, "Size": "8x8", "Model": "a/b-c_d", "Lora hashes": "x: 12ab, y: 34cd",
        "Empty": "", "Skipped": None, "Path": "C:\\models\\x.safetensors", "Quote": '"', "Backslash": "\\",
    }),
    ("many\n\nlines\n  indented", "neg\nsecond", {"Steps": 2, "Sampler": "DDIM", "Seed": 0, "Size": "16x8"}),
    ("Steps: 1, Seed: 2, Size: 3", "", {"Steps": 5, "Seed": 6, "Size": "7x7"}),
]


def _expected(prompt: str, negative: str, params: dict) -> dict:
    want = {"Prompt": "\n".join(line.strip() for line in prompt.split("\n")).strip(), "Negative prompt": negative}
    want.update({k: str(v) for k, v in params.items() if v is not None and v != ""})
    return want


def test_quote_only_what_would_end_a_field() -> None:
    assert quote("Euler a") == "Euler a"
    assert quote(7.0) == "7.0"
    assert quote('5" "tall"') == '5" "tall"'
    assert quote("a, b") == '"a, b"'
    assert quote("C:/x") == '"C:/x"'
    assert quote("line\nbreak") == '"line\\nbreak"'
    assert quote('say "a, b"') == '"say \\"a, b\\""'
    assert quote("猫, 犬") == '"猫, 犬"'


def test_written_text_by_hand() -> None:
    text = format_infotext("a cat\nsitting", "blurry, bad", {
        "Steps": 20, "Sampler": "Euler a", "Skipped": None, "Empty": "", "Lora hashes": "x: 1, y: 2", "Seed": 5,
    })
    assert text == (
        'a cat\nsitting\nNegative prompt: blurry, bad\nSteps: 20, Sampler: Euler a, Lora hashes: "x: 1, y: 2", Seed: 5'
    )
    assert format_infotext("p", "", {"Steps": 1}) == "p\nSteps: 1"


def test_fields_by_hand() -> None:
    line = (
        'Steps: 20, Hires upscale: 2, Flag, Lora hashes: "a: 1, b: \\"2\\"", Bad "quote": 3, Xx: "not json, Yy: 4, Z: 5'
    )
    assert parameter_fields(line) == [
        ("Steps", "20"), ("Hires upscale", "2"), ("Lora hashes", 'a: 1, b: "2"'), ("Xx", '"not json'), ("Yy", "4"),
    ]
    assert parameter_fields('Model: "quoted" tail, Seed: 1') == [("Model", '"quoted" tail'), ("Seed", "1")]
    assert parameter_fields("Ab: , Bc:2,Cd :  x y  ") == [("Ab", ""), ("Bc", "2"), ("Cd", "x y")]


def test_a_last_line_with_fewer_than_three_fields_is_prompt() -> None:
    assert parse_infotext("a cat\nStyle: oil, Mood: calm") == {
        "Prompt": "a cat\nStyle: oil, Mood: calm", "Negative prompt": "",
    }
    assert parse_infotext("x\nNegative prompt: y\nAa: 1, Bb: 2, Cc: 3") == {
        "Prompt": "x", "Negative prompt": "y", "Aa": "1", "Bb": "2", "Cc": "3",
    }


@pytest.mark.parametrize("case", range(len(WRITTEN)))
def test_round_trip(case: int) -> None:
    prompt, negative, params = WRITTEN[case]
    assert parse_infotext(format_infotext(prompt, negative, params)) == _expected(prompt, negative, params)


# -- the WebUI's own reader -----------------------------------------------------------------------------


def _webui_test_bed() -> tuple[Path, Path] | None:
    root = Path(os.environ.get("A1111_ROOT") or "/work/tb/a1111")
    python, webui = root / "venv" / "bin" / "python", root / "webui"
    if python.is_file() and (webui / "modules" / "infotext_utils.py").is_file():
        return python, root
    return None


# Runs in the test bed's Python, in the WebUI's folder: infotexts (JSON) on stdin, parsed dicts out.
_WEBUI_SIDE = """
import json, sys
sys.argv = [sys.argv[0], "--skip-torch-cuda-test", "--use-cpu", "all", "--no-half"]
texts = json.load(sys.stdin)
from modules import shared_init
shared_init.initialize()
from modules import infotext_utils
out = [{k: str(v) for k, v in infotext_utils.parse_generation_parameters(t).items()} for t in texts]
sys.stdout.write("\\n@@RESULT@@" + json.dumps(out))
"""


def test_the_webui_reads_what_we_write() -> None:
    found = _webui_test_bed()
    if found is None:
        pytest.skip("no WebUI test bed (set A1111_ROOT to a folder with venv/ and webui/ from .ci/testbed)")
    python, root = found
    texts = [format_infotext(*case) for case in WRITTEN]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(LD_LIBRARY_PATH=str(root / "tvstub"), HF_HOME=str(root / "hf-home"), HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [str(python), "-c", _WEBUI_SIDE], input=json.dumps(texts), capture_output=True, text=True,
        timeout=300, cwd=root / "webui", env=env,
    )
    assert run.returncode == 0, f"the WebUI's reader failed to run:\n{run.stderr[-3000:]}"
    webui = json.loads(run.stdout.rpartition("@@RESULT@@")[2])
    for (prompt, negative, params), text, theirs in zip(WRITTEN, texts, webui):
        ours = parse_infotext(text)
        assert ours == _expected(prompt, negative, params), text
        width, _, height = ours.pop("Size").partition("x")
        assert (theirs.pop("Size-1"), theirs.pop("Size-2")) == (width, height), text
        # The WebUI adds defaults for keys absent from the text; every key we read it reads the same.
        assert {k: theirs.get(k) for k in ours} == ours, text
