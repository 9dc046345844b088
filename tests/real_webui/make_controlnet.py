"""Builds the real-host tier's random ControlNet for SD 1.5, the way ControlNet's own training starts one.

Run by the test bed's Python (the WebUI's venv) in the WebUI's folder, never by the project's own venv
(``.ci/build_testbed.py`` runs it once, after the bed's full-size ``sd15-random.safetensors``)::

    python make_controlnet.py <webui folder> <sd-webui-controlnet folder> <SD 1.5 checkpoint> <out .safetensors>

The network is sd-webui-controlnet's own ``scripts/cldm.py`` ``ControlNet``, built from the configuration its
``controlnet_model_guess.py`` picks for a file without ``label_emb`` (``controlnet_default_config``: SD 1.5's
full layout, 320 channels, context 768, so it pairs only with a full-size SD 1.5 checkpoint), with 3 hint
channels. As ControlNet's training does, it starts as a copy of the checkpoint's UNet encoder
(``time_embed``, ``input_blocks``, ``middle_block``). Training would then move the layers that start at 0
(the ``zero_convs``, ``middle_block_out`` and the hint block's last conv), which would otherwise make a
ControlNet that changes nothing. Here they are drawn anew and scaled, measured on a simple control image:
the zero convs get PyTorch's default init, scaled so that each one's output has :data:`CONTROL_SCALE` times
the spread of the UNet feature it is added to; the hint block's convs are drawn layer by layer with zero
biases so that the control image reaches its output (at the default init their biases swamp it), the last
one scaled to :data:`HINT_SCALE` times the spread of the first input block's output it is added to. That
moves the WebUI's picture clearly (about 26 dB from stock's at weight 1, 64x64) and keeps it finite.

The file holds bare keys in fp16, as ControlNet's ``extract_controlnet.py`` writes them. Before it is
written, it is read back through ControlNet's own loader (``build_model_by_guess``): it must pick the same
configuration, and every tensor must arrive unchanged. A seed always gives the same file.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SEED = 3
#: The hint block's output spread, relative to the first input block's output it is added to.
HINT_SCALE = 1.0
#: Each zero conv's output spread, relative to the UNet feature the WebUI adds it to.
CONTROL_SCALE = 0.5
#: The UNet's parts a ControlNet starts as a copy of (``model.diffusion_model.<part>.*`` in a checkpoint).
COPIED = ("time_embed.", "input_blocks.", "middle_block.")
#: The parts that start at 0 in ControlNet's training, re-initialised here.
ZERO_STARTED = ("zero_convs.", "middle_block_out.", "input_hint_block.")
UNET_PREFIX = "model.diffusion_model."


def use_controlnet_code(webui: str, controlnet: str) -> None:
    """Make ``scripts.cldm`` importable as the WebUI does when it loads the extension: sgm imported with its
    repository on ``sys.path`` and the repository taken off again (its own ``scripts`` package would hide
    the extension's), the extension's folder and the WebUI's first, and no command line for the WebUI's
    ``modules.shared`` to parse."""
    sys.argv = sys.argv[:1]
    sys.path.insert(0, os.path.join(webui, "repositories", "generative-models"))
    import sgm  # noqa: F401

    sys.path.pop(0)
    sys.path[:0] = [controlnet, webui]


def control_image(size: int = 64) -> Any:
    """A hint as ControlNet feeds it for module "none": RGB in [0, 1], (1, 3, size, size); white shapes on black."""
    import torch

    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    square = (x >= size // 8) & (x < size // 2) & (y >= size // 8) & (y < size // 2)
    disc = (x - 0.7 * size) ** 2 + (y - 0.65 * size) ** 2 < (0.2 * size) ** 2
    return (square | disc).float().expand(1, 3, size, size).clone()


def unet_encoder(checkpoint: str) -> dict[str, Any]:
    """The checkpoint's UNet encoder tensors as float32, named as in ControlNet."""
    from safetensors import safe_open

    with safe_open(checkpoint, framework="pt") as f:
        return {key[len(UNET_PREFIX):]: f.get_tensor(key).float() for key in f.keys()
                if key.startswith(UNET_PREFIX) and key[len(UNET_PREFIX):].startswith(COPIED)}


def scale_to(conv: Any, ratio: float) -> None:
    conv.weight.mul_(ratio)
    conv.bias.mul_(ratio)


def init_hint_block(block: Any, hint: Any, last_spread: float) -> None:
    """Each conv of the hint block drawn anew (normal weights, zero bias) and scaled, layer by layer, so that
    its output on ``hint`` has a spread of 1 (the last: ``last_spread``). At PyTorch's default init the
    biases of its eight convs swamp the picture: the block's output hardly depends on the control image."""
    import torch

    convs = [m for m in block if isinstance(m, torch.nn.Conv2d)]
    act = hint
    for layer in block:
        if isinstance(layer, torch.nn.Conv2d):
            torch.nn.init.normal_(layer.weight, std=layer.weight[0].numel() ** -0.5)
            torch.nn.init.zeros_(layer.bias)
            layer.weight.mul_((last_spread if layer is convs[-1] else 1.0) / float(layer(act).std()))
        act = layer(act)


def build(checkpoint: str) -> tuple[Any, dict[str, Any]]:
    """The random ControlNet (float32, eval) and the configuration it was built from."""
    import copy

    import torch

    from scripts.cldm import ControlNet, timestep_embedding
    from scripts.controlnet_model_guess import controlnet_default_config

    config = copy.deepcopy(controlnet_default_config)
    config.update(hint_channels=3, use_fp16=False)
    torch.manual_seed(SEED)
    net = ControlNet(**config).eval()
    encoder = unet_encoder(checkpoint)
    missing, unexpected = net.load_state_dict(encoder, strict=False)
    assert not unexpected, f"UNet tensors ControlNet has no place for: {unexpected[:5]}"
    assert all(key.startswith(ZERO_STARTED) for key in missing), [k for k in missing if not k.startswith(ZERO_STARTED)]
    assert encoder, f"no UNet in {checkpoint}"

    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(SEED))
    t = torch.tensor([500.0])
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(SEED + 1))
    hint = control_image()
    convs = [zc[0] for zc in net.zero_convs] + [net.middle_block_out[0]]
    with torch.no_grad():
        for conv in [*convs, net.input_hint_block[-1]]:
            assert not conv.weight.any(), "a zero-started conv is not 0 in a fresh ControlNet"
            conv.reset_parameters()
        emb = net.time_embed(timestep_embedding(t, net.model_channels))
        h0 = net.input_blocks[0](x, emb, context)
        init_hint_block(net.input_hint_block, hint, HINT_SCALE * float(h0.std()))
        # each zero conv's output is added to the UNet feature its input is the copy of
        spreads: dict[int, tuple[float, float]] = {}
        hooks = [conv.register_forward_hook(
            lambda m, args, out, i=i: spreads.__setitem__(i, (float(args[0].std()), float(out.std()))))
            for i, conv in enumerate(convs)]
        net(x, hint, t, context)
        for i, conv in enumerate(convs):
            scale_to(conv, CONTROL_SCALE * spreads[i][0] / spreads[i][1])
        outs = net(x, hint, t, context)
        for hook in hooks:
            hook.remove()
        other = net(x, hint.flip(-1), t, context)  # another control image
    for i, out in enumerate(outs):
        assert out.isfinite().all(), f"control output {i} is not finite"
        ratio = float(out.std()) / spreads[i][0]
        assert abs(ratio - CONTROL_SCALE) < 0.1 * CONTROL_SCALE, f"control output {i}: {ratio:.3f} of its feature"
    change = max(float((a - b).std() / a.std()) for a, b in zip(outs, other))
    assert change > 0.05, f"the control outputs hardly depend on the control image ({change:.3f})"
    print(  # noqa: T201 (run by the test bed; its output is read on failure)
        f"ControlNet (seed {SEED}): {len(encoder)} UNet encoder tensors copied; {len(outs)} control outputs at "
        f"{CONTROL_SCALE} of their features' spread; another control image moves them by up to {change:.0%}")
    return net, config


def check_loads_in_controlnet(path: str, net: Any, config: dict[str, Any]) -> None:
    """The file read back by ControlNet's own loader: the same layout and every tensor unchanged (at fp16)."""
    import torch

    from scripts.controlnet_model_guess import build_model_by_guess
    from scripts.utils import load_state_dict

    loaded = build_model_by_guess(load_state_dict(path), None, path).model.control_model.float().eval()
    ours = {k: v.half().float() for k, v in net.state_dict().items()}
    theirs = loaded.state_dict()
    assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not different, f"tensors ControlNet's loader does not read as written: {different[:5]}"
    assert loaded.model_channels == config["model_channels"] and loaded.dims == 2


def main(webui: str, controlnet: str, checkpoint: str, out: str) -> None:
    from safetensors.torch import save_file

    use_controlnet_code(os.path.abspath(webui), os.path.abspath(controlnet))
    net, config = build(checkpoint)
    state = {k: v.half().contiguous() for k, v in net.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file(state, out + ".part.safetensors")
    check_loads_in_controlnet(out + ".part.safetensors", net, config)
    os.replace(out + ".part.safetensors", out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
