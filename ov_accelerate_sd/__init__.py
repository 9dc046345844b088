"""The Stable Diffusion layer of Accelerate with OpenVINO.

Turns a WebUI single-file checkpoint into diffusers components offline, encodes WebUI prompts,
maps WebUI sampler names, reproduces the WebUI's seeds, routes the UNet, VAE and text
encoder(s) through ``ov_backend`` and writes PNGs the WebUI's PNG Info tab reads. It knows
nothing of the WebUI itself (no ``modules``, no gradio). Importing it does no work.
"""

__all__: list[str] = []
