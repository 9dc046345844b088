"""Entry point loaded by the WebUI: the "Accelerate with OpenVINO" dropdown script and the always-on
"OpenVINO" section (logic in ov_accelerate_webui)."""

from ov_accelerate_webui import create_extension

loaded = create_extension()
Script = loaded.script_class
Section = loaded.section_class
loaded.register_callbacks()
