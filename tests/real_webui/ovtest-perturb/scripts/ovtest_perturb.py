"""Test-only always-on script for the real-host tier: adds seeded noise to one model part's output.

It shows that a picture comparison could fail: with the UNet's, the VAE's or the text encoder's output
perturbed by a small relative error, the picture must move beyond the tier's PSNR bound. It is also the
"other always-on script" whose arguments follow ours in an API request. Arguments (API
``alwayson_scripts``: ``{"ovtest perturb": {"args": [part, relative_std]}}``): part is "", "unet",
"vae", "te" (SD 1.x's text encoder) or "te0", "te1" (that SDXL embedder's output as A1111's prompt wrapper
gets it, its pooled output left as it is); relative_std is the noise's standard deviation relative to the
output's. Part "attention"
perturbs nothing: it writes the name of the UNet's attention forward in use while the generation runs into
the infotext ("ovtest attention"). Part "replace-unet" perturbs nothing either: it replaces the UNet's
forward for the generation with one that runs the class's own forward, never the instance's (as
sd-webui-controlnet's hook does), so whatever was routed there is not called. Part "replace-unet-inner"
does that and also replaces the forward of the UNet's middle block with one that runs the class's forward
(as ControlNet's reference-only and style-align modes do with their group-norm hooks).
"""

import gradio as gr
import torch
from modules import scripts


def _targets(model, part):
    if part == "unet":
        return model.model.diffusion_model, "forward"
    if part == "vae":
        return model.first_stage_model, "decode"
    if part == "te":
        return model.cond_stage_model.wrapped.transformer.text_model.final_layer_norm, "forward"
    if part in ("te0", "te1"):
        return model.conditioner.embedders[int(part[2:])], "encode_with_transformers"
    raise ValueError(f"unknown part {part!r}")


class OvtestPerturb(scripts.Script):
    def title(self):
        return "ovtest perturb"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        return [gr.Textbox(value="", label="ovtest part"), gr.Number(value=0.0, label="ovtest relative std")]

    def process(self, p, part="", relative_std=0.0, *args):
        self._saved = None
        if part == "attention":
            from ldm.modules.attention import CrossAttention

            p.extra_generation_params["ovtest attention"] = CrossAttention.forward.__name__
            return
        if part in ("replace-unet", "replace-unet-inner"):
            unet = p.sd_model.model.diffusion_model

            def controlnet_like_forward(*a, **k):
                return type(unet).forward(unet, *a, **k)

            self._saved = [(unet, "forward", unet.__dict__.get("forward"))]
            unet.forward = controlnet_like_forward
            if part == "replace-unet-inner":
                block = unet.middle_block

                def group_norm_like_forward(*a, **k):
                    return type(block).forward(block, *a, **k)

                self._saved.append((block, "forward", block.__dict__.get("forward")))
                block.forward = group_norm_like_forward
            return
        if not part or not relative_std:
            return
        module, method = _targets(p.sd_model, part)
        previous = module.__dict__.get(method)
        inner = getattr(module, method)
        generator = torch.Generator().manual_seed(99)

        def perturbed(*a, **k):
            out = inner(*a, **k)
            noise = torch.randn(out.shape, generator=generator).to(out.dtype)
            result = out + noise * float(relative_std) * out.float().std().to(out.dtype)
            if hasattr(out, "pooled"):  # A1111's OpenCLIP-bigG wrapper hangs the pooled output on the tensor
                result.pooled = out.pooled
            return result

        setattr(module, method, perturbed)
        self._saved = [(module, method, previous)]

    def postprocess(self, p, processed, *args):
        for module, method, previous in reversed(getattr(self, "_saved", None) or ()):
            if previous is None:
                module.__dict__.pop(method, None)
            else:
                setattr(module, method, previous)
        self._saved = None
