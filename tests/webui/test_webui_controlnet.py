"""sd-webui-controlnet's networks through OpenVINO, in the fake host: found through the hook ControlNet's script
keeps (``latest_network.control_params``), compiled once per network object, and every unit type OpenVINO does
not run said by name. (The real extension, and the UNet block by block under its forward: the real tier,
``tests/real_webui/test_real_webui_controlnet.py``.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff
from torch import nn


class TinyControl(nn.Module):
    """Stands in for ``cldm.ControlNet``: residuals from the latent, the hint and the prompt."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.latent = nn.Conv2d(4, 4, 3, padding=1)
        self.hint = nn.Conv2d(3, 4, 8, stride=8)

    def forward(self, x: Any, hint: Any, timesteps: Any, context: Any, y: Any = None,
                control_type: Any = None) -> list[Any]:
        h = self.latent(x) + self.hint(hint)
        h = h + context.mean((1, 2))[:, None, None, None] + timesteps[:, None, None, None] * 1e-3
        return [h, h * 0.5]


def control_script(kinds: tuple[str, ...]) -> type:
    """An always-on script that, like ControlNet's, keeps its hook in ``latest_network`` (one param per unit of
    ``kinds``) and replaces the UNet's forward in ``process`` with one that adds the networks' output."""
    from modules import scripts

    networks = [TinyControl() for _ in kinds]

    class FakeControlNet(scripts.Script):
        def title(self) -> str:
            return "controlnet"

        def show(self, is_img2img: bool) -> Any:
            return scripts.AlwaysVisible

        def process(self, p: Any, *args: Any) -> None:
            unet = p.sd_model.model.diffusion_model
            params = [SimpleNamespace(control_model_type=SimpleNamespace(name=kind),
                                      control_model=SimpleNamespace(control_model=net, is_control_lora=False))
                      for kind, net in zip(kinds, networks)]
            self.latest_network = SimpleNamespace(control_params=params)
            hint = torch.linspace(0, 1, 3 * p.height * p.width).reshape(1, 3, p.height, p.width)

            def forward(x: Any, timesteps: Any = None, context: Any = None, **kwargs: Any) -> Any:
                out = type(unet).forward(unet, x, timesteps, context, **kwargs)
                for param in params:
                    control = param.control_model.control_model(x=x, hint=hint.expand(x.shape[0], -1, -1, -1),
                                                                timesteps=timesteps, context=context)
                    out = out + 0.1 * control[0] + 0.1 * control[1]
                return out

            unet.forward = forward

        def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
            p.sd_model.model.diffusion_model.__dict__.pop("forward", None)
            self.latest_network = None

    return FakeControlNet


def run(fake_host: Any, extension: Any, settings: Any, kinds: tuple[str, ...] | type, accelerated: bool = True,
        **params: Any) -> Any:
    from modules import scripts

    runner = scripts.ScriptRunner(is_img2img=False)
    runner.add(kinds if isinstance(kinds, type) else control_script(kinds))
    p = make_p(fake_host, **{"steps": 3, **params})
    p.scripts, p.script_args = runner, []
    return extension.run(p, settings) if accelerated else fake_host.processing.process_images(p)


def test_a_controlnet_network_runs_in_openvino_and_a_new_generation_compiles_nothing(fake_host: Any, extension: Any,
                                                                                      f32: Any) -> None:
    script = control_script(("ControlNet",))
    stock = run(fake_host, extension, f32, script, accelerated=False)
    plain = fake_host.processing.process_images(make_p(fake_host, steps=3))
    assert max_pixel_diff(stock, plain) > 1  # the control moves the picture
    fast = run(fake_host, extension, f32, script)
    report = extension.last_run_report()
    assert report["calls"]["controlnet.control_model"] == 3, report["calls"]
    assert report["compiles"] > 0
    assert max_pixel_diff(fast, stock) <= IMAGE_TOLERANCE
    assert "ControlNet" not in fast.infotexts[0].split("OpenVINO:")[1], fast.infotexts[0]
    assert not fake_host.model.model.diffusion_model.__dict__.get("forward")  # nothing left patched
    again = run(fake_host, extension, f32, script, seed=8)  # another picture, the same network object
    report = extension.last_run_report()
    assert report["calls"]["controlnet.control_model"] == 3 and report["compiles"] == 0, report["status"]
    assert max_pixel_diff(again, run(fake_host, extension, f32, script, accelerated=False, seed=8)) <= IMAGE_TOLERANCE


def test_unit_types_openvino_does_not_run_are_said_and_the_others_still_run(fake_host: Any, extension: Any,
                                                                           f32: Any) -> None:
    stock = run(fake_host, extension, f32, ("ControlNet", "T2I_Adapter"), accelerated=False)
    fast = run(fake_host, extension, f32, ("ControlNet", "T2I_Adapter"))
    report = extension.last_run_report()
    assert report["calls"]["controlnet.control_model"] == 3, report["calls"]
    why = report["pytorch"]["ControlNet unit 2 (T2I_Adapter)"]["why"]
    assert "type T2I_Adapter" in why and "ControlNet, ControlNetUnion" in why, why
    assert "Ran in PyTorch, not OpenVINO: ControlNet unit 2 (T2I_Adapter)" in report["status"]
    assert "ControlNet unit 2 in PyTorch" in fast.infotexts[0], fast.infotexts[0]
    assert max_pixel_diff(fast, stock) <= IMAGE_TOLERANCE
