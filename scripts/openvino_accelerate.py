"""Entry point loaded by the WebUI: the "Accelerate with OpenVINO" script (logic in ov_accelerate_webui)."""

from ov_accelerate_webui import create_extension

loaded = create_extension()
Script = loaded.script_class
loaded.register_callbacks()
