"""``import ov_backend`` registers the backend name without loading dynamo's other backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: modules of torch._dynamo.backends that are the registry itself, not a backend
_REGISTRY_MODULES = {"torch._dynamo.backends", "torch._dynamo.backends.registry", "torch._dynamo.backends.common"}


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_registers_the_name_without_loading_other_backends():
    found = _fresh(
        "import json, sys\n"
        "import ov_backend\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('torch._dynamo.backends'))\n"
        "import torch._dynamo\n"
        "from ov_backend.backend import ov_backend as fn\n"
        "print(json.dumps({'loaded': loaded, 'same': torch._dynamo.lookup_backend('ov_backend') is fn}))\n"
    )
    assert [m for m in found["loaded"] if m not in _REGISTRY_MODULES] == []
    assert "torch._dynamo.backends.registry" in found["loaded"]
    assert found["same"] is True


def test_name_found_through_the_entry_point_before_any_import():
    """dynamo loads the entry point by importing the package: registering there must not clash."""
    found = _fresh(
        "import json, torch, torch._dynamo\n"
        "fn = torch._dynamo.lookup_backend('ov_backend')\n"
        "import ov_backend.backend\n"
        "m = torch.nn.Linear(3, 2).eval()\n"
        "with torch.no_grad():\n"
        "    out = torch.compile(m, backend='ov_backend',\n"
        "                        options={'config': {'INFERENCE_PRECISION_HINT': 'f32'}})(torch.ones(1, 3))\n"
        "    diff = (out - m(torch.ones(1, 3))).abs().max().item()\n"
        "print(json.dumps({'same': fn is ov_backend.backend.ov_backend, 'diff': diff}))\n"
    )
    assert found["same"] is True
    assert found["diff"] < 1e-5


def test_a_copy_without_the_entry_point_registers_the_name_on_import():
    """A copy on ``sys.path`` (e.g. in a WebUI extension's folder) has no installed entry point: importing
    it registers the name itself, through torch's public registry, without loading dynamo's other
    backends."""
    found = _fresh(
        "import importlib.metadata, json, sys\n"
        "plain = importlib.metadata.entry_points\n"
        "def without_ours(**kwargs):\n"
        "    found = plain(**kwargs)\n"
        "    if kwargs.get('group') != 'torch_dynamo_backends':\n"
        "        return found\n"
        "    return [p for p in found if p.name != 'ov_backend']\n"
        "importlib.metadata.entry_points = without_ours\n"
        "import ov_backend\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('torch._dynamo.backends'))\n"
        "import torch._dynamo\n"
        "from torch._dynamo.backends.registry import _COMPILER_FNS\n"
        "registered = 'ov_backend' in _COMPILER_FNS\n"
        "openvino = sorted(m for m in sys.modules if m.split('.')[0] == 'openvino')\n"
        "importlib.metadata.entry_points = plain  # (torch reads the real ones when it compiles)\n"
        "fn = torch._dynamo.lookup_backend('ov_backend')\n"
        "model = torch.compile(torch.nn.Linear(3, 2), backend=fn, options={'precision': 'f32'})\n"
        "model(torch.ones(1, 3))\n"
        "print(json.dumps({'loaded': loaded, 'registered': registered, 'openvino': openvino,\n"
        "                  'ran': 'ov_backend.backend' in sys.modules}))\n"
    )
    assert found["registered"] is True
    assert [m for m in found["loaded"] if m not in _REGISTRY_MODULES] == []
    # the name loads the backend (and OpenVINO) on its first graph, not on import
    assert found["openvino"] == [] and found["ran"] is True
