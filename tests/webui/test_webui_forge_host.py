"""The Forge host (``ov_accelerate_webui.forge``) on a small stand-in of Forge's model objects.

The stand-ins keep the attribute names and call shapes of Forge main at dfdcbab6 (``backend/diffusion_engine``,
``backend/patcher``, ``backend/modules/k_model.py``): ``forge_objects`` with a ``UnetPatcher``-like ``unet`` whose
``clone()`` deep-copies its ``model_options`` as Forge's does, a KModel with ``apply_model`` calling
``diffusion_model``, ``vae.first_stage_model`` and ``clip.cond_stage_model.clip_l/clip_g`` each holding a
transformers CLIP text model. The real Forge runs the same code in ``tests/real_forge``.
"""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel

from ov_accelerate_webui import forge, forge_unet, hosts
from ov_accelerate_webui.model_parts import UnsupportedModel
from ov_accelerate_webui.routing import Route, mark_ours


class TinyUNet(nn.Module):
    """Forge's UNet forward signature; writes its bookkeeping into ``transformer_options`` as Forge's does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, timesteps: Any = None, context: Any = None, y: Any = None, control: Any = None,
                transformer_options: dict | None = None, **kwargs: Any) -> torch.Tensor:
        transformer_options = {} if transformer_options is None else transformer_options
        transformer_options["original_shape"] = list(x.shape)
        return self.conv(x) + self.proj(context.mean(1))[:, :, None, None]


class KModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.diffusion_model = TinyUNet()

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, c_crossattn: Any = None, control: Any = None,
                    transformer_options: dict | None = None, **kwargs: Any) -> torch.Tensor:
        return self.diffusion_model(x, t, context=c_crossattn, control=control,
                                    transformer_options=transformer_options or {}, **kwargs)


class UnetPatcher:
    def __init__(self, model: KModel, model_options: dict[str, Any] | None = None) -> None:
        self.model = model
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}

    def clone(self) -> UnetPatcher:
        return UnetPatcher(self.model, copy.deepcopy(self.model_options))  # as Forge's ModelPatcher.clone

    def set_model_unet_function_wrapper(self, fn: Any) -> None:
        self.model_options["model_function_wrapper"] = fn


def clip(hidden: int = 8) -> nn.Module:
    holder = nn.Module()
    holder.transformer = CLIPTextModel(CLIPTextConfig(vocab_size=50, hidden_size=hidden, intermediate_size=16,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      max_position_embeddings=77))
    return holder


def engine(encoders: tuple[str, ...] = ("clip_l",), flag: str = "is_sd1", name: str = "StableDiffusion") -> Any:
    vae = nn.Module()
    vae.encoder, vae.decoder = nn.Conv2d(3, 8, 1), nn.Conv2d(4, 3, 1)
    cond = nn.Module()
    for encoder in encoders:
        setattr(cond, encoder, clip())
    objects = types.SimpleNamespace(unet=UnetPatcher(KModel()), vae=types.SimpleNamespace(first_stage_model=vae),
                                    clip=types.SimpleNamespace(cond_stage_model=cond))
    model = type(name, (), {})()
    model.forge_objects = objects
    model.is_sd1 = model.is_sd2 = model.is_sdxl = model.is_sd3 = False
    if flag:
        setattr(model, flag, True)
    return model


def test_sd1_parts_are_found_where_forge_keeps_them() -> None:
    model = engine()
    targets = forge.find_targets(model, ("unet", "vae", "text_encoder"))
    assert [(t.part, t.label) for t in targets] == [
        ("unet", "unet.model.diffusion_model"),
        ("vae", "vae.first_stage_model.decoder"),
        ("vae", "vae.first_stage_model.encoder"),
        ("text_encoder", "clip.cond_stage_model.clip_l.transformer.text_model.encoder"),
    ]
    unet = targets[0]
    assert unet.module is model.forge_objects.unet.model.diffusion_model
    assert unet.per_call and unet.check is forge_unet.unet_check and unet.compiled is forge_unet.unet_forward
    assert not any(t.per_call for t in targets[1:])
    # Forge's LoRA loader sets weights without requires_grad; dynamo's guards check the flag
    assert not any(p.requires_grad for t in targets for p in t.module.parameters())
    assert [t.label for t in forge.find_targets(model, ("vae",))] == [t.label for t in targets[1:3]]


def test_sdxl_base_and_refiner_layouts_and_a_wrong_one() -> None:
    base = forge.find_targets(engine(("clip_l", "clip_g"), "is_sdxl"), ("text_encoder",))
    assert [t.label.split(".")[2] for t in base] == ["clip_g", "clip_l"]
    refiner = forge.find_targets(engine(("clip_g",), "is_sdxl"), ("text_encoder",))
    assert [t.label.split(".")[2] for t in refiner] == ["clip_g"]
    with pytest.raises(UnsupportedModel, match=r"\(clip_l\) are not a layout Forge loads for it: expected clip_g "
                                               r"\(SDXL refiner\) or clip_g \+ clip_l \(SDXL base\)"):
        forge.find_targets(engine(("clip_l",), "is_sdxl"), ("text_encoder",))


def test_another_family_runs_in_pytorch_with_its_name_and_forges_stand_in_waits() -> None:
    with pytest.raises(UnsupportedModel, match=r"This checkpoint \(Flux\) is not supported: in Forge, .* SD 1.x, "
                                               r"SD 2.x and SDXL; other families run in plain PyTorch"):
        forge.find_targets(engine(flag="", name="Flux"), ("unet",))
    with pytest.raises(UnsupportedModel, match=r"\(SD3\)"):
        forge.find_targets(engine(flag="is_sd3"), ("unet",))
    host = forge.ForgeHost()
    fake_initial = type("FakeInitialModel", (), {})()
    assert host.stand_in(fake_initial) and host.stand_in(None) and not host.stand_in(engine())
    assert not hosts.A1111Host().stand_in(None)


def in_extension(folder: str, source: str, name: str) -> Any:
    """A function whose code lives in a Forge built-in extension's folder (as a patch of FreeU's does)."""
    namespace: dict[str, Any] = {}
    exec(compile(source, f"/forge/extensions-builtin/{folder}/scripts/patch.py", "exec"), namespace)
    return namespace[name]


def test_unet_check_names_what_changes_the_unets_work() -> None:
    unet, x = TinyUNet(), torch.zeros(2, 4, 8, 8)
    bookkeeping = {"cond_or_uncond": [1, 0], "sigmas": torch.ones(2), "cond_indices": [0], "uncond_indices": [1],
                   "cond_mark": torch.ones(2)}
    assert forge_unet.unet_check(unet, (x, torch.ones(2)), {"context": x, "control": None,
                                                       "transformer_options": bookkeeping}) == ""
    freeu = in_extension("sd_forge_freeu", "def output_block_patch(h, hsp, o):\n    return h, hsp\n",
                         "output_block_patch")
    options = dict(bookkeeping, patches={"output_block_patch": [freeu]})
    why = forge_unet.unet_check(unet, (x,), {"transformer_options": options})
    assert why == ("FreeU (output_block_patch) patch the UNet's blocks with Python code a compiled graph would not "
                   "follow")
    assert why.short == "FreeU"  # the infotext's note: "UNet in PyTorch (FreeU)"
    why = forge_unet.unet_check(unet, (x,), {"control": {"input": [x]}, "control_model": object(),
                                             "transformer_options": options})
    assert why.startswith("Forge's integrated ControlNet adds its residuals inside the UNet; FreeU") and \
        why.short == "ControlNet + FreeU", why
    assert "inputs beyond its own (denoise_mask)" in forge_unet.unet_check(unet, (x,), {"denoise_mask": x})
    # ControlNet's model passed along outside its guidance range (no residuals): the UNet's own work
    assert forge_unet.unet_check(unet, (x,), {"control": None, "control_model": object()}) == ""
    odd = forge_unet.unet_check(unet, (x,), {"transformer_options": {"block_modifiers": [lambda h, *a: h]}})
    assert "test_webui_forge_host.py" in odd and "(block_modifiers)" in odd, odd  # an unknown patch: where it is


def test_unet_inputs_and_forward_take_the_unets_own_inputs() -> None:
    x, t, c, y = torch.randn(2, 4, 8, 8), torch.ones(2), torch.randn(2, 77, 8), torch.randn(2, 6)
    call = {"context": c, "y": y, "control": None, "transformer_options": {"a": 1}}
    args, kwargs = forge_unet.unet_inputs((x, t), call)
    assert args[0] is x and kwargs == {"timesteps": t, "context": c, "y": y}
    args, kwargs = forge_unet.unet_inputs((x, t, c), {"transformer_options": {}})
    assert set(kwargs) == {"timesteps", "context"} and kwargs["context"] is c
    unet = TinyUNet()
    expected = unet(x, t, context=c, transformer_options={})
    assert torch.equal(forge_unet.unet_forward(unet, x, t, c), expected)


def routed_unet(model: Any, seen: list[str]) -> Route:
    unet = model.forge_objects.unet.model.diffusion_model

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.append("openvino")
        return type(unet).forward(unet, *args, **kwargs)

    return Route(unet, mark_ours(forward), "unet.model.diffusion_model", per_call=True)


def sample(patcher: UnetPatcher) -> torch.Tensor:
    """What Forge's sampling function does with the patcher's UNet function wrapper."""
    x, t, c = torch.randn(2, 4, 8, 8), torch.ones(2), {"c_crossattn": torch.randn(2, 77, 8)}
    wrapper = patcher.model_options.get("model_function_wrapper")
    if wrapper is None:
        return patcher.model.apply_model(x, t, **c)
    return wrapper(patcher.model.apply_model, {"input": x, "timestep": t, "c": c, "cond_or_uncond": [1, 0]})


def test_the_unet_is_routed_through_a_function_wrapper_on_a_clone_for_each_sampling_call() -> None:
    model, seen = engine(), []
    p = types.SimpleNamespace(sd_model=model)
    original = model.forge_objects.unet
    unet = original.model.diffusion_model
    assert forge.ForgeHost().route_for_sampling(p, [routed_unet(model, seen)]) == ""
    clone = model.forge_objects.unet
    assert clone is not original and clone.model is original.model
    assert "model_function_wrapper" not in original.model_options  # the batch's own copy only
    sample(clone)
    assert seen == ["openvino"]
    assert "forward" not in vars(unet)  # routed for the call only
    sample(original)
    assert seen == ["openvino"]  # Forge's own patcher: plain PyTorch
    # a later clone (another extension's) deep-copies the options: the wrapper is copied as itself, no module with it
    again = clone.clone()
    assert again.model_options["model_function_wrapper"] is clone.model_options["model_function_wrapper"]
    assert again.model.diffusion_model is unet
    sample(again)
    assert seen == ["openvino", "openvino"]


def test_a_wrapper_set_before_runs_around_the_routed_unet() -> None:
    model, seen = engine(), []
    calls = []

    def multidiffusion(apply_model: Any, call: dict[str, Any]) -> Any:
        calls.append("tiles")
        return apply_model(call["input"], call["timestep"], **call["c"])

    model.forge_objects.unet.set_model_unet_function_wrapper(multidiffusion)
    forge.ForgeHost().route_for_sampling(types.SimpleNamespace(sd_model=model), [routed_unet(model, seen)])
    sample(model.forge_objects.unet)
    assert calls == ["tiles"] and seen == ["openvino"]


def test_routes_of_another_unet_are_not_put_on_this_one() -> None:
    model, other = engine(), engine()
    why = forge.ForgeHost().route_for_sampling(types.SimpleNamespace(sd_model=model), [routed_unet(other, [])])
    assert "is not the one routed for this generation" in why
    assert "model_function_wrapper" not in model.forge_objects.unet.model_options
    assert forge.ForgeHost().route_for_sampling(types.SimpleNamespace(sd_model=model), []) == ""


def attention_modules(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    def attention_sub_quad(*a: Any) -> None: ...
    def attention_pytorch(*a: Any) -> None: ...
    def normal_attention_single_head_spatial(*a: Any) -> None: ...
    def pytorch_attention_single_head_spatial(*a: Any) -> None: ...

    attention = types.SimpleNamespace(attention_pytorch=attention_pytorch,
                                      pytorch_attention_single_head_spatial=pytorch_attention_single_head_spatial)
    unet = types.SimpleNamespace(attention_function=attention_sub_quad)
    vae = types.SimpleNamespace(attention_function_single_head_spatial=normal_attention_single_head_spatial)
    for name, module in (("backend.attention", attention), ("backend.nn.unet", unet), ("backend.nn.vae", vae)):
        monkeypatch.setitem(sys.modules, name, module)
    return attention, unet, vae


def test_the_routed_parts_attention_is_forges_fused_one_for_the_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    attention, unet, vae = attention_modules(monkeypatch)
    before = (unet.attention_function, vae.attention_function_single_head_spatial)
    with forge.ForgeAttention(("unet", "vae", "text_encoder")) as swapped:
        assert unet.attention_function is attention.attention_pytorch
        assert vae.attention_function_single_head_spatial is attention.pytorch_attention_single_head_spatial
        assert swapped.replaced == "sub-quadratic, and split in the VAE"
        unet.attention_function = before[0]  # a model load inside the generation
        swapped.ensure()
        assert unet.attention_function is attention.attention_pytorch
    assert (unet.attention_function, vae.attention_function_single_head_spatial) == before
    with pytest.raises(KeyboardInterrupt), forge.ForgeAttention(("vae",)) as swapped:
        assert unet.attention_function is before[0] and swapped.replaced == "split in the VAE"
        raise KeyboardInterrupt
    assert (unet.attention_function, vae.attention_function_single_head_spatial) == before


def test_the_host_is_detected_from_what_the_webui_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "modules_forge", raising=False)
    assert isinstance(hosts.detect(), hosts.A1111Host)
    monkeypatch.setitem(sys.modules, "modules_forge", types.ModuleType("modules_forge"))
    detected = hosts.detect()
    assert isinstance(detected, forge.ForgeHost) and detected.name == "Forge"


def test_step_caching_refuses_an_ldm_shaped_unet_of_another_module_with_the_reason() -> None:
    from ov_accelerate_sd.unet_split import StepCacheUnsupported, split_unet

    unet = nn.Module()
    for name in ("input_blocks", "output_blocks"):
        setattr(unet, name, nn.ModuleList([nn.Identity(), nn.Identity()]))
    unet.middle_block, unet.out, unet.time_embed, unet.model_channels = nn.Identity(), nn.Identity(), nn.Identity(), 4
    # (an nn.Module's module is torch.nn.modules.module: no LDM th/timestep_embedding, as Forge's backend.nn.unet)
    with pytest.raises(StepCacheUnsupported, match=r"Module is not LDM/SGM's UNetModel \(its module "
                                                   r"torch.nn.modules.module has no th or timestep_embedding\)"):
        split_unet(unet, 1)


def test_forge_neos_attention_names_are_swapped_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forge Neo's ``backend/attention.py`` (Haoming02/sd-webui-forge-classic, neo) picks ``attention_basic`` on the
    CPU, which asks ``force_upcast_attention_dtype()`` on every call (a graph break each time), and names the VAE's
    functions ``normal_attention_vae`` and ``pytorch_attention_vae``."""
    def attention_basic(*a: Any) -> None: ...
    def attention_pytorch(*a: Any) -> None: ...
    def normal_attention_vae(*a: Any) -> None: ...
    def pytorch_attention_vae(*a: Any) -> None: ...

    attention = types.SimpleNamespace(attention_pytorch=attention_pytorch, pytorch_attention_vae=pytorch_attention_vae)
    unet = types.SimpleNamespace(attention_function=attention_basic)
    vae = types.SimpleNamespace(attention_function_single_head_spatial=normal_attention_vae)
    for name, module in (("backend.attention", attention), ("backend.nn.unet", unet), ("backend.nn.vae", vae)):
        monkeypatch.setitem(sys.modules, name, module)
    with forge.ForgeAttention(("unet", "vae")) as swapped:
        assert unet.attention_function is attention_pytorch
        assert vae.attention_function_single_head_spatial is pytorch_attention_vae
        assert swapped.replaced == "basic, and slice in the VAE"
    assert unet.attention_function is attention_basic
    assert vae.attention_function_single_head_spatial is normal_attention_vae
