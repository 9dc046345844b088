"""LoRA as A1111 v1.10.1's Lora extension applies it, on tiny models.

The oracles are written here by hand from A1111's code: the text its ``re.sub`` leaves, the
kohya names (literal strings, resolved with ``get_submodule``), each kind's change computed by
explicit sums and blocks, the hash from the safetensors layout. None reads ``lora_layers``' tables.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ov_accelerate_sd.loader import Components, load_components
from ov_accelerate_sd.lora import (
    LoraError,
    LoraRef,
    LoraWeights,
    find_lora,
    hashes_infotext,
    parse_prompt_loras,
    short_hash,
)
from ov_accelerate_sd.pipeline import GenerationJob, Generator
from ov_accelerate_sd.pnginfo import format_infotext

TO_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
TO_Q_LDM = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q"
CONV1 = "down_blocks.0.resnets.0.conv1"
CONV1_LDM = "lora_unet_input_blocks_1_0_in_layers_2"
TO_OUT = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"
TO_OUT_LDM = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_out_0"
TE_Q = "text_model.encoder.layers.0.self_attn.q_proj"
TE_FC2 = "lora_te_text_model_encoder_layers_1_mlp_fc2"


def _components(tiny_checkpoints: dict, family: str) -> Components:
    return load_components(tiny_checkpoints[family][0])


@pytest.fixture(scope="module")
def _sd1_once(tiny_checkpoints: dict) -> Components:
    return _components(tiny_checkpoints, "sd1")


@pytest.fixture
def sd1(_sd1_once: Components) -> Iterator[Components]:
    """The tiny SD 1.x components, loaded once; each test's changes of their weights are undone after it."""
    saved = [(p, p.detach().clone()) for m in (_sd1_once.unet, *_sd1_once.text_encoders) for p in m.parameters()]
    yield _sd1_once
    with torch.no_grad():
        for param, value in saved:
            param.copy_(value)


def _save(folder: Path, name: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.safetensors"
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _weights(c: Components) -> dict[str, torch.Tensor]:
    out = {f"unet.{k}": v.clone() for k, v in c.unet.state_dict().items()}
    for i, encoder in enumerate(c.text_encoders):
        out.update({f"te{i}.{k}": v.clone() for k, v in encoder.state_dict().items()})
    return out


def _changed(before: dict, c: Components) -> set[str]:
    return {k for k, v in _weights(c).items() if not torch.equal(v, before[k])}


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.3


def _outer(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_r up[o, r] down[r, ...], by broadcasting (not a matmul)."""
    return (up.reshape(*up.shape[:2], *[1] * (down.ndim - 1)) * down.unsqueeze(0)).sum(1)


def _cp(core: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W[o, i, k, l] = sum_pq core[p, q, k, l] a[p, o] b[q, i], by loops."""
    out = torch.zeros(a.shape[1], b.shape[1], *core.shape[2:])
    for p in range(core.shape[0]):
        for q in range(core.shape[1]):
            out += a[p][:, None, None, None] * b[q][None, :, None, None] * core[p, q]
    return out


def _blocks(w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The Kronecker product, block by block."""
    m, n = w2.shape
    out = torch.zeros(w1.shape[0] * m, w1.shape[1] * n)
    for a in range(w1.shape[0]):
        for b in range(w1.shape[1]):
            out[a * m:(a + 1) * m, b * n:(b + 1) * n] = w1[a, b] * w2
    return out


# ---- tags -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "text", "refs"), [
    ("a cat, <lora:x:0.5>, dog", "a cat, , dog", [LoraRef("x", 0.5, 0.5)]),
    ("<lora:x>a cat", "a cat", [LoraRef("x", 1.0, 1.0)]),
    ("a <lora:x:0.5:0.25> b", "a  b", [LoraRef("x", 0.5, 0.25)]),
    ("<lora:x:te=0.3>", "", [LoraRef("x", 0.3, 0.3)]),  # the UNet multiplier defaults to the text encoder's
    ("<lora:x:1:unet=0.2>", "", [LoraRef("x", 1.0, 0.2)]),
    ("<lora:x:unet=0.2:0.7>", "", [LoraRef("x", 0.7, 0.2)]),
    ("<lora:x:0.5:0.6:8>", "", [LoraRef("x", 0.5, 0.6, 8)]),
    ("<lora:x:1:dyn=4>", "", [LoraRef("x", 1.0, 1.0, 4)]),
    ("line one\n<lora:my lora:-1>", "line one\n", [LoraRef("my lora", -1.0, -1.0)]),
    ("<lora:x:0.5", "<lora:x:0.5", []),  # not a tag: left as it is
    # a name twice: loaded twice, both with the last tag's multipliers
    ("<lora:a:0.5> x <lora:b> <lora:a:0.2>", " x  ", [LoraRef("a", 0.2, 0.2), LoraRef("b"), LoraRef("a", 0.2, 0.2)]),
    # lyco is the Lora extension's alias; tags are grouped by the name first written
    ("<lora:b> <lyco:a:0.5> <lora:c>", "  ", [LoraRef("b"), LoraRef("c"), LoraRef("a", 0.5, 0.5)]),
])
def test_tags_are_cut_out_as_the_webui_does(prompt: str, text: str, refs: list[LoraRef]) -> None:
    assert parse_prompt_loras(prompt) == (text, refs)


def test_other_extra_networks_are_removed_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert parse_prompt_loras("a <hypernet:h:1> b") == ("a  b", [])
    assert "<hypernet:h:1>" in caplog.text


@pytest.mark.parametrize(("prompt", "says"), [
    ("<lora:x:abc>", "'abc' is not a finite number"),
    ("<lora:x:te=strong>", "'strong'"),
    ("<lora:x:1:1:2.5>", "whole number"),
    ("<lora:x:nan>", "finite"),
    ("<lora:te=1>", "no LoRA name"),
])
def test_bad_tags_say_what_is_wrong_and_what_is_right(prompt: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_prompt_loras(prompt)
    assert "<lora:name:0.8>" in str(info.value)


# ---- files ------------------------------------------------------------------------------------------------


def test_find_looks_in_subfolders_in_the_webuis_order(tmp_path: Path) -> None:
    lora, lyco = tmp_path / "Lora", tmp_path / "LyCORIS"
    one = {"lora_unet_x.alpha": torch.tensor(1.0)}
    top = _save(lora, "a", one)
    nested = _save(lora / "style" / "2", "b", one)
    _save(lora / ".hidden", "c", one)
    (lora / "notes.txt").write_text("not a LoRA")
    lyco.mkdir()
    torch.save(one, lyco / "d.pt")
    assert find_lora("a", [lora, lyco]) == top
    assert find_lora("b", [lora, lyco]) == nested
    assert find_lora("d", [lora, lyco]) == lyco / "d.pt"
    # the same name twice: the WebUI keeps the last it lists (a subfolder after its parent, a later folder)
    deeper = _save(lora / "z", "a", one)
    assert find_lora("a", [lora]) == deeper
    assert find_lora("a", [lora, _save(lyco, "a", one).parent]) == lyco / "a.safetensors"

    with pytest.raises(LoraError) as info:
        find_lora("c", [lora, tmp_path / "nowhere"])
    message = str(info.value)
    assert "'c'" in message and str(lora) in message and "nowhere (missing)" in message
    assert "available: a, b" in message
    with pytest.raises(LoraError, match="did you mean 'b'"):
        find_lora("bb", [lora])


def test_a_pickle_that_needs_code_is_refused(tmp_path: Path, sd1: Components) -> None:
    torch.save({"lora_unet_x.alpha": torch.tensor(1.0), "meta": argparse.Namespace(a=1)}, tmp_path / "evil.pt")
    with pytest.raises(LoraError, match="weights_only"):
        LoraWeights(sd1).apply([LoraRef("evil")], [tmp_path])


# ---- each kind on one layer ---------------------------------------------------------------------------------

T = dict[str, torch.Tensor]

LAYER_CASES: dict[str, tuple[str, str, T, Callable[[T], torch.Tensor]]] = {}


def _case(name: str, module: str, key: str, tensors: T, expected: Callable[[T], torch.Tensor]) -> None:
    LAYER_CASES[name] = (module, key, tensors, expected)


_case("lora, LDM name, alpha/rank", TO_Q, TO_Q_LDM,
      {"lora_up.weight": _rand(32, 4, seed=1), "lora_down.weight": _rand(4, 32, seed=2), "alpha": torch.tensor(2.0)},
      lambda w: 0.5 * _outer(w["lora_up.weight"], w["lora_down.weight"]))
_case("lora, diffusers name, no alpha", TO_Q, "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
      {"lora_up.weight": _rand(32, 2, seed=3), "lora_down.weight": _rand(2, 32, seed=4)},
      lambda w: _outer(w["lora_up.weight"], w["lora_down.weight"]))
_case("lora, scale overrides alpha", TO_Q, TO_Q_LDM,
      {"lora_up.weight": _rand(32, 2, seed=3), "lora_down.weight": _rand(2, 32, seed=4),
       "alpha": torch.tensor(2.0), "scale": torch.tensor(0.25)},
      lambda w: 0.25 * _outer(w["lora_up.weight"], w["lora_down.weight"]))
_case("lora A/B names", TO_Q, TO_Q_LDM,
      {"lora_B.weight": _rand(32, 2, seed=5), "lora_A.weight": _rand(2, 32, seed=6), "alpha": torch.tensor(1.0)},
      lambda w: 0.5 * _outer(w["lora_B.weight"], w["lora_A.weight"]))
_case("locon 3x3", CONV1, CONV1_LDM,
      {"lora_up.weight": _rand(32, 4, 1, 1, seed=7), "lora_down.weight": _rand(4, 32, 3, 3, seed=8),
       "alpha": torch.tensor(1.0)},
      lambda w: 0.25 * _outer(w["lora_up.weight"][:, :, 0, 0], w["lora_down.weight"]))
_case("locon with lora_mid", CONV1, CONV1_LDM,
      {"lora_up.weight": _rand(32, 3, 1, 1, seed=9), "lora_down.weight": _rand(3, 32, 1, 1, seed=10),
       "lora_mid.weight": _rand(3, 3, 3, 3, seed=11), "alpha": torch.tensor(3.0)},
      lambda w: _cp(w["lora_mid.weight"], w["lora_up.weight"][:, :, 0, 0].T, w["lora_down.weight"][:, :, 0, 0]))
_case("loha", TO_Q, TO_Q_LDM,
      {"hada_w1_a": _rand(32, 4, seed=12), "hada_w1_b": _rand(4, 32, seed=13), "hada_w2_a": _rand(32, 4, seed=14),
       "hada_w2_b": _rand(4, 32, seed=15), "alpha": torch.tensor(2.0)},
      lambda w: 0.5 * _outer(w["hada_w1_a"], w["hada_w1_b"]) * _outer(w["hada_w2_a"], w["hada_w2_b"]))
_case("loha with t1/t2 on a conv", CONV1, CONV1_LDM,
      {"hada_w1_a": _rand(2, 32, seed=16), "hada_w1_b": _rand(2, 32, seed=17), "hada_t1": _rand(2, 2, 3, 3, seed=18),
       "hada_w2_a": _rand(2, 32, seed=19), "hada_w2_b": _rand(2, 32, seed=20), "hada_t2": _rand(2, 2, 3, 3, seed=21),
       "alpha": torch.tensor(1.0)},
      lambda w: 0.5 * _cp(w["hada_t1"], w["hada_w1_a"], w["hada_w1_b"])
      * _cp(w["hada_t2"], w["hada_w2_a"], w["hada_w2_b"]))
# A1111: a LoKr of full w1 and w2 has no rank, so its alpha is not used (scale 1)
_case("lokr, full factors", TO_Q, TO_Q_LDM,
      {"lokr_w1": _rand(4, 4, seed=22), "lokr_w2": _rand(8, 8, seed=23), "alpha": torch.tensor(3.0)},
      lambda w: _blocks(w["lokr_w1"], w["lokr_w2"]))
_case("lokr, w2 factored: alpha / rank of w2", TO_Q, TO_Q_LDM,
      {"lokr_w1": _rand(4, 4, seed=24), "lokr_w2_a": _rand(8, 2, seed=25), "lokr_w2_b": _rand(2, 8, seed=26),
       "alpha": torch.tensor(1.0)},
      lambda w: 0.5 * _blocks(w["lokr_w1"], _outer(w["lokr_w2_a"], w["lokr_w2_b"])))
_case("full diff", TO_Q, TO_Q_LDM, {"diff": _rand(32, 32, seed=27)}, lambda w: w["diff"])
_case("dyn: first ranks only, alpha over all", TO_Q, TO_Q_LDM,
      {"lora_up.weight": _rand(32, 4, seed=28), "lora_down.weight": _rand(4, 32, seed=29), "alpha": torch.tensor(4.0)},
      lambda w: _outer(w["lora_up.weight"][:, :2], w["lora_down.weight"][:2]))


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_each_kind_changes_its_layer_by_the_hand_computed_delta(case: str, sd1: Components, tmp_path: Path) -> None:
    module, key, tensors, expected = LAYER_CASES[case]
    _save(tmp_path, "one", {f"{key}.{part}": value for part, value in tensors.items()})
    dyn = 2 if case.startswith("dyn") else None
    weight = sd1.unet.get_submodule(module).weight
    before, original = _weights(sd1), weight.detach().clone()
    assert LoraWeights(sd1).apply([LoraRef("one", 0.5, 0.8, dyn)], [tmp_path])
    assert _changed(before, sd1) == {f"unet.{module}.weight"}
    torch.testing.assert_close(weight.detach(), original + 0.8 * expected(tensors), rtol=1e-5, atol=1e-6)


def test_full_diff_changes_the_bias_too(sd1: Components, tmp_path: Path) -> None:
    diff, diff_b = _rand(32, 32, seed=30), _rand(32, seed=31)
    _save(tmp_path, "full", {f"{TO_OUT_LDM}.diff": diff, f"{TO_OUT_LDM}.diff_b": diff_b})
    layer = sd1.unet.get_submodule(TO_OUT)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    LoraWeights(sd1).apply([LoraRef("full", 1.0, 0.5)], [tmp_path])
    torch.testing.assert_close(layer.weight.detach(), weight + 0.5 * diff, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.detach(), bias + 0.5 * diff_b, rtol=1e-5, atol=1e-6)


def test_dora_rescales_the_columns(sd1: Components, tmp_path: Path) -> None:
    up, down, dora = _rand(32, 2, seed=32), _rand(2, 32, seed=33), _rand(1, 32, seed=34).abs() + 1
    _save(tmp_path, "dora", {f"{TO_Q_LDM}.lora_up.weight": up, f"{TO_Q_LDM}.lora_down.weight": down,
                             f"{TO_Q_LDM}.alpha": torch.tensor(1.0), f"{TO_Q_LDM}.dora_scale": dora})
    weight = sd1.unet.get_submodule(TO_Q).weight
    original = weight.detach().clone()
    LoraWeights(sd1).apply([LoraRef("dora", 1.0, 0.7)], [tmp_path])
    merged = original + 0.5 * _outer(up, down)
    columns = torch.stack([merged[:, j] * dora[0, j] / merged[:, j].pow(2).sum().sqrt() for j in range(32)], 1)
    torch.testing.assert_close(weight.detach(), original + 0.7 * (columns - original), rtol=1e-5, atol=1e-6)


def test_text_encoder_and_unet_take_their_own_multiplier(sd1: Components, tmp_path: Path) -> None:
    up, down = _rand(32, 2, seed=35), _rand(2, 32, seed=36)
    _save(tmp_path, "both", {f"{k}.{p}": v for k in (TO_Q_LDM, "lora_te_text_model_encoder_layers_0_self_attn_q_proj")
                             for p, v in (("lora_up.weight", up), ("lora_down.weight", down))})
    te_q = sd1.text_encoders[0].get_submodule(TE_Q).weight
    unet_q = sd1.unet.get_submodule(TO_Q).weight
    te0, unet0 = te_q.detach().clone(), unet_q.detach().clone()
    LoraWeights(sd1).apply([LoraRef("both", 0.25, 2.0)], [tmp_path])
    torch.testing.assert_close(te_q.detach(), te0 + 0.25 * _outer(up, down), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unet_q.detach(), unet0 + 2.0 * _outer(up, down), rtol=1e-5, atol=1e-6)


def test_sd1_takes_lora_te1_names_too(sd1: Components, tmp_path: Path) -> None:
    """A1111: "some SD1 Loras also have correct compvis keys"; its ``lora_te_`` names reach the encoder layers only."""
    _save(tmp_path, "te1", {**_te_lora(["lora_te1_text_model_encoder_layers_1_mlp_fc1"]),
                            "lora_te_text_model_final_layer_norm.diff": torch.ones(32)})
    before = _weights(sd1)
    weights = LoraWeights(sd1)
    weights.apply([LoraRef("te1")], [tmp_path])
    assert _changed(before, sd1) == {"te0.text_model.encoder.layers.1.mlp.fc1.weight"}
    assert weights.applied[0].unmatched == ("lora_te_text_model_final_layer_norm",)


# ---- text encoder names of SD 2.x and SDXL --------------------------------------------------------------------


def _te_lora(keys: list[str], width: int = 32) -> T:
    out = {}
    for i, key in enumerate(keys):
        rows = 64 if key.endswith("fc1") else width
        cols = 64 if key.endswith("fc2") else width
        out[f"{key}.lora_up.weight"] = _rand(rows, 2, seed=40 + i)
        out[f"{key}.lora_down.weight"] = _rand(2, cols, seed=60 + i)
    return out


def test_sd2_openclip_attention_changes_only_with_q_k_v_and_out(tiny_checkpoints: dict, tmp_path: Path) -> None:
    c = _components(tiny_checkpoints, "sd2")
    layer = "lora_te_text_model_encoder_layers_0_"
    attention = [layer + f"self_attn_{p}_proj" for p in ("q", "k", "v", "out")]
    unused = "lora_te_text_model_encoder_layers_2_mlp_fc1"
    _save(tmp_path, "full-set", _te_lora(attention + [layer + "mlp_fc1", unused]))
    _save(tmp_path, "q-only", _te_lora(attention[:1] + [layer + "mlp_fc1"]))
    before = _weights(c)
    weights = LoraWeights(c)
    weights.apply([LoraRef("full-set")], [tmp_path])
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1")
    assert _changed(before, c) == {f"te0.text_model.encoder.layers.0.{n}.weight" for n in names}
    # layer 2 is the WebUI's last OpenCLIP layer, which SD 2.x never reads and our encoder leaves out
    assert weights.applied[0].unmatched == ()
    weights.apply([LoraRef("q-only")], [tmp_path])
    assert _changed(before, c) == {"te0.text_model.encoder.layers.0.mlp.fc1.weight"}


def test_sdxl_te1_and_te2_go_to_their_encoders(tiny_checkpoints: dict, tmp_path: Path) -> None:
    c = _components(tiny_checkpoints, "sdxl")
    keys = ["lora_te1_text_model_encoder_layers_1_self_attn_q_proj", "lora_te2_text_model_encoder_layers_0_mlp_fc2",
            "lora_te_text_model_encoder_layers_0_self_attn_q_proj"]  # lora_te_ is SD 1.x/2.x's: no module here
    _save(tmp_path, "xl", _te_lora(keys))
    before = _weights(c)
    weights = LoraWeights(c)
    weights.apply([LoraRef("xl")], [tmp_path])
    assert _changed(before, c) == {"te0.text_model.encoder.layers.1.self_attn.q_proj.weight",
                                   "te1.text_model.encoder.layers.0.mlp.fc2.weight"}
    assert weights.applied[0].unmatched == (keys[2],)


# ---- apply, restore, change ---------------------------------------------------------------------------------


def _attention_lora(unet: torch.nn.Module, seed: int, scale: float = 1.0) -> T:
    """A kohya LoRA (diffusers names) on every attention projection of the UNet and q_proj of the text encoder."""
    out: T = {}
    for n, (name, m) in enumerate(unet.named_modules()):
        if isinstance(m, torch.nn.Linear) and ".attn" in name:
            key = "lora_unet_" + name.replace(".", "_")
            out[f"{key}.lora_up.weight"] = _rand(m.out_features, 2, seed=seed + n) * scale
            out[f"{key}.lora_down.weight"] = _rand(2, m.in_features, seed=seed + n + 1000)
    return out


def test_apply_restore_and_changes_of_the_set(sd1: Components, tmp_path: Path) -> None:
    lora_a = _attention_lora(sd1.unet, 100)
    _save(tmp_path, "a", lora_a)
    _save(tmp_path, "b", {**_attention_lora(sd1.unet, 200), **_te_lora([TE_FC2])})
    params = {name: p for name, p in sd1.unet.named_parameters()}
    before = _weights(sd1)
    weights = LoraWeights(sd1)

    assert weights.apply([LoraRef("a", 1.0, 0.5)], [tmp_path])
    with_a = _weights(sd1)
    assert len(_changed(before, sd1)) == len(lora_a) // 2
    versions = {name: p._version for name, p in params.items()}
    assert not weights.apply([LoraRef("a", 1.0, 0.5)], [tmp_path])  # the same set: nothing written
    assert {name: p._version for name, p in params.items()} == versions

    assert weights.apply([LoraRef("b", 0.3, 0.7)], [tmp_path])  # a new set starts from the originals
    with_b = _weights(sd1)
    assert weights.restore()
    assert _changed(before, sd1) == set()  # bit for bit
    assert not weights.restore()
    fresh = LoraWeights(sd1)
    fresh.apply([LoraRef("b", 0.3, 0.7)], [tmp_path])
    assert _changed(with_b, sd1) == set()
    fresh.apply([LoraRef("a", 1.0, 0.5)], [tmp_path])
    assert _changed(with_a, sd1) == set()
    # the same Parameter objects throughout (a compiled model follows them), and only the touched originals kept
    assert all(p is params[name] for name, p in sd1.unet.named_parameters())
    assert len(fresh._originals) == len(_changed(before, sd1))

    # a changed file is read again
    _save(tmp_path, "a", _attention_lora(sd1.unet, 300))
    os.utime(tmp_path / "a.safetensors", ns=(1, 10**18))
    assert fresh.apply([LoraRef("a", 1.0, 0.5)], [tmp_path])
    assert _changed(with_a, sd1)
    assert fresh.apply([], [tmp_path]) and _changed(before, sd1) == set()


def test_a_lora_of_another_family_is_refused_and_leaves_no_change(tiny_checkpoints: dict, tmp_path: Path) -> None:
    sd1_unet = tiny_checkpoints["sd1"][1][0]
    _save(tmp_path, "for-sd1", {**_attention_lora(sd1_unet, 400),
                                **_te_lora(["lora_te_text_model_encoder_layers_0_self_attn_q_proj"])})
    _save(tmp_path, "for-xl", _te_lora(["lora_te2_text_model_encoder_layers_0_mlp_fc1"]),
          metadata={"ss_base_model_version": "sdxl_base_v1-0"})
    xl = _components(tiny_checkpoints, "sdxl")
    before = _weights(xl)
    with pytest.raises(LoraError, match=r"'for-sd1' .* does not fit this sdxl model: \d+ of its layers have other"):
        LoraWeights(xl).apply([LoraRef("for-sd1")], [tmp_path])
    assert _changed(before, xl) == set()
    with pytest.raises(LoraError, match="changes nothing in this sd1 model.*SDXL"):
        LoraWeights(_components(tiny_checkpoints, "sd1")).apply([LoraRef("for-xl")], [tmp_path])


def test_a_kind_we_do_not_apply_is_named(sd1: Components, tmp_path: Path) -> None:
    _save(tmp_path, "norm", {f"{TO_Q_LDM}.w_norm": torch.ones(32), f"{TO_Q_LDM}.b_norm": torch.zeros(32)})
    with pytest.raises(LoraError, match=r"\['b_norm', 'w_norm'\], a kind we do not apply"):
        LoraWeights(sd1).apply([LoraRef("norm")], [tmp_path])


def test_generation_with_a_lora_differs_and_weight_zero_is_none(sd1: Components, tmp_path: Path) -> None:
    lora = {**_attention_lora(sd1.unet, 500, scale=3.0), **_te_lora(["lora_te_text_model_encoder_layers_0_mlp_fc1"])}
    _save(tmp_path, "style", lora)
    generator = Generator(sd1)
    job = GenerationJob("a cat", steps=2, width=64, height=64, seed=3).validated()
    weights = LoraWeights(sd1)

    def render(refs: list[LoraRef]) -> np.ndarray:
        weights.apply(refs, [tmp_path])
        return np.asarray(generator.run_batch(job, 0)[0].image).astype(np.int16)

    plain = render([])
    with_lora = render([LoraRef("style")])
    assert np.abs(with_lora - plain).mean() > 1.0
    assert np.array_equal(render([LoraRef("style", 0.0, 0.0)]), plain)
    assert np.array_equal(render([]), plain)


# ---- infotext ---------------------------------------------------------------------------------------------


def test_hashes_are_the_webuis(tmp_path: Path, sd1: Components) -> None:
    tensors = {f"{TO_Q_LDM}.diff": _rand(32, 32, seed=50)}
    plain = _save(tmp_path, "plain", tensors)
    data = plain.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    assert short_hash(plain) == hashlib.sha256(data[8 + header_len:]).hexdigest()[:12]  # kohya's "addnet" hash
    given = _save(tmp_path, "given", tensors, metadata={"sshs_model_hash": "0123456789abcdef"})
    assert short_hash(given) == "0123456789ab"
    pickled = tmp_path / "pickled.pt"
    torch.save(tensors, pickled)
    assert short_hash(pickled) == hashlib.sha256(pickled.read_bytes()).hexdigest()[:12]

    a, b = "a" * 12, "b" * 12
    entry = hashes_infotext([("my:lo,ra", a), ("b", b), ("b", b), ("nohash", "")])
    assert entry == {"Lora hashes": f"mylora: {a}, b: {b}"}
    assert format_infotext("p", "", {"Steps": 1, **entry}).endswith(f'Lora hashes: "mylora: {a}, b: {b}"')
    assert hashes_infotext([]) == {}

    weights = LoraWeights(sd1)
    weights.apply([LoraRef("plain"), LoraRef("given", 0.5)], [tmp_path])
    assert weights.infotext() == {"Lora hashes": f"plain: {short_hash(plain)}, given: 0123456789ab"}
