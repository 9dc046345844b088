"""The WebUI prompt syntax: weights, escapes, unbalanced brackets, BREAK, 75-token chunks, padding.

Three kinds of oracle: weights worked out by hand; the WebUI's own ``parse_prompt_attention``
run in the real test bed's Python (skipped when the test bed is absent); and a stand-in text
encoder whose hidden states are known, to check the weights and padding the encoder sees.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ov_accelerate_sd.prompts import CHUNK_LENGTH, PromptEncoder, chunk_tokens, parse_prompt_attention
from ov_accelerate_sd.tokenizer import clip_tokenizer

UP, DOWN = 1.1, 1 / 1.1


# -- the parser, by hand ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("", [("", 1.0)]),
        ("just some words, nothing else", [("just some words, nothing else", 1.0)]),
        ("((glow)) lamp", [("glow", 1.0 * UP * UP), (" lamp", 1.0)]),
        ("[[fog]] hill", [("fog", 1.0 * DOWN * DOWN), (" hill", 1.0)]),
        ("(tree:0.7)", [("tree", 0.7)]),
        ("(tree:  1.25 )", [("tree", 1.25)]),
        ("(tree:+2.)", [("tree", 2.0)]),
        ("(tree:-.5)", [("tree", -0.5)]),
        ("((tree:2))", [("tree", 2.0 * UP)]),
        ("[(tree:3)]", [("tree", 3.0 * DOWN)]),
        ("(a:1.1)(b)", [("ab", 1.1)]),  # equal weights join
        ("x (a) (b)", [("x ", 1.0), ("a", UP), (" ", 1.0), ("b", UP)]),
        ("((a) b)", [("a", UP * UP), (" b", UP)]),
        # a colon is a weight only as ":<number>)"
        ("(ratio 16:9 wide)", [("ratio 16:9 wide", UP)]),
        ("(ratio 16:9)", [("ratio 16", 9.0)]),
        ("(a:1e2)", [("a:1e2", UP)]),
        ("[tree:2]", [("tree:2", DOWN)]),
        ("word :1.5) tail", [("word :1.5) tail", 1.0)]),
        # escapes
        ("\\(not a group\\)", [("(not a group)", 1.0)]),
        ("\\[x\\] and (\\(y\\))", [("[x] and ", 1.0), ("(y)", UP)]),
        ("back\\\\slash", [("back\\slash", 1.0)]),
        ("lone \\q dropped", [("lone q dropped", 1.0)]),
        # unbalanced
        ("close) only]", [("close) only]", 1.0)]),
        ("open (rest of it", [("open ", 1.0), ("rest of it", UP)]),
        ("open [[rest", [("open ", 1.0), ("rest", 1.0 * DOWN * DOWN)]),
        ("[(mixed", [("mixed", 1.0 * UP * DOWN)]),  # never-closed round groups count first
        ("(a [b) c]", [("a ", UP), ("b", 1.0 * UP * DOWN), (" c", DOWN)]),  # kinds pair up separately
        ("()", [("", 1.0)]),
        ("[ ]", [(" ", DOWN)]),
        # BREAK
        ("one BREAK two", [("one", 1.0), ("BREAK", -1.0), ("two", 1.0)]),
        ("BREAK", [("", 1.0), ("BREAK", -1.0), ("", 1.0)]),
        ("x,BREAK,y", [("x,", 1.0), ("BREAK", -1.0), (",y", 1.0)]),
        ("BREAKFAST break Break", [("BREAKFAST break Break", 1.0)]),
        ("(a BREAK b)", [("a", UP), ("BREAK", -UP), ("b", UP)]),  # scaled: no longer a break
        # unicode
        ("(café:1.5) 猫", [("café", 1.5), (" 猫", 1.0)]),
        ("(a:２.５)", [("a", 2.5)]),  # full-width digits are digits to the WebUI too
    ],
)
def test_parse_weights_worked_by_hand(prompt: str, expected: list[tuple[str, float]]) -> None:
    got = parse_prompt_attention(prompt)
    assert [text for text, _ in got] == [text for text, _ in expected]
    assert [weight for _, weight in got] == pytest.approx([weight for _, weight in expected], rel=1e-12)


@pytest.mark.parametrize("prompt", ["(a:1.2.3)", "x (a:.) y", "((a:-.))"])
def test_parse_rejects_a_weight_that_is_not_a_number(prompt: str) -> None:
    with pytest.raises(ValueError, match="is not a number"):
        parse_prompt_attention(prompt)


# -- the parser against the WebUI's own ------------------------------------------------------

ORACLE_PROMPTS = [
    "",
    "   ",
    "a castle on a hill",
    "(castle)",
    "((((castle))))",
    "[[[castle]]]",
    "(castle:1.35), [moat], ((towers:0.8) flags)",
    "((a:1.3) (b:0.7):1.2)",
    "[(a) [b] (c:2)]",
    "([(a)]:1.3)",  # the order of the factors changes the last bit here
    "[(((a)))]",
    "(a)(b)[c][d](e:1.1)",
    "(a) (b) [c] [d]",
    "(",
    ")",
    "[",
    "]",
    ")(",
    "][",
    "((open twice",
    "[[open [thrice",
    "([mixed open",
    "[(mixed open",
    "[(((never closed",  # and here: round groups never closed count before square ones
    "(a [b) c]",
    "[a (b] c)",
    "close)) more] text",
    "(a:1.2",
    "(a:1.2]",
    "a:1.2)",
    "(time 12:30)",
    "(ratio 16:9 screen)",
    "(a: 1.5 )",
    "(a:\t2\n)",
    "(a:+.5)",
    "(a:-1)",
    "(a:0)",
    "(a:007)",
    "(a:1e3)",
    "(a:+)",
    "(a::1.2)",
    "(a:1.2):1.3)",
    "(a:1.2.3)",
    "x (a:.) y",
    "x:1..2)",
    "(" + "9" * 400 + ")",
    "(a:" + "9" * 400 + ")",
    "((a:0):" + "9" * 400 + ")",
    "\\(a\\) \\[b\\] \\\\ c",
    "\\",
    "(a)\\",
    "a\\b\\:c",
    "(\\)",
    "(\\())",
    "[\\]]",
    "\\\\(a)",
    "BREAK",
    "BREAK BREAK",
    " BREAK a",
    "a BREAK",
    "a BREAK  BREAK b",
    "a\nBREAK\tb",
    "aBREAK BREAKb BREAK_ BREAK1 BREAKé éBREAK",
    "break Break BREAK",
    "x,BREAK,y",
    "(BREAK)",
    "(BREAK:1)",
    "(BREAK:0)",
    "[a BREAK b]",
    "(a) BREAK [b]",
    "a:BREAK:b",
    "\\(BREAK\\)",
    "a\\BREAK b",
    "BREAK\u0301 x",
    "x\u00a0BREAK\u3000y",
    "(猫:1.2) と [犬]",
    "(café:１.５)",
    "(a:٣)",
    "emoji (🙂:1.1) [🐈]",
    "a, (b, c:1.1), d",
    "masterpiece, best quality, (detailed face:1.2), [[blurry]], (((sharp)))",
]


def find_webui_test_bed() -> tuple[Path, Path] | None:
    """(Python of the test bed's venv, the WebUI's prompt_parser.py), or None if absent.

    The test bed is the real WebUI built by ``.ci/testbed``; ``A1111_ROOT`` names
    its folder (default ``/work/tb/a1111``).
    """
    root = Path(os.environ.get("A1111_ROOT") or "/work/tb/a1111")
    python, parser = root / "venv" / "bin" / "python", root / "webui" / "modules" / "prompt_parser.py"
    if python.is_file() and parser.is_file():
        return python, parser
    return None


# Runs in the test bed's Python: reads prompts (JSON) on stdin, writes one result per prompt.
_WEBUI_SIDE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("webui_prompt_parser", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for prompt in json.load(sys.stdin):
    try:
        results.append({"pieces": [[t, float(w).hex()] for t, w in module.parse_prompt_attention(prompt)]})
    except ValueError as exc:
        results.append({"error": type(exc).__name__})
json.dump(results, sys.stdout)
"""


def _ours(prompt: str) -> dict:
    try:
        return {"pieces": [[text, float(weight).hex()] for text, weight in parse_prompt_attention(prompt)]}
    except ValueError as exc:
        return {"error": type(exc).__name__}


def _random_prompts(count: int, seed: int) -> list[str]:
    parts = list("()[]\\:, ab.1234567890+-") + ["BREAK", " BREAK ", "\t", "é", "_", "１", ":1.2)", "(x:0.5)"]
    rng = random.Random(seed)
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def test_parser_agrees_with_the_webui_exactly() -> None:
    found = find_webui_test_bed()
    if found is None:
        pytest.skip("no WebUI test bed (set A1111_ROOT to a folder with venv/ and webui/ from .ci/testbed)")
    python, parser = found
    prompts = ORACLE_PROMPTS + _random_prompts(500, seed=11)
    run = subprocess.run(
        [str(python), "-c", _WEBUI_SIDE, str(parser)], input=json.dumps(prompts), capture_output=True,
        text=True, timeout=300, cwd=parser.parent.parent,
    )
    assert run.returncode == 0, f"the WebUI's parser failed to run:\n{run.stderr[-3000:]}"
    webui = json.loads(run.stdout)
    assert len(webui) == len(prompts)
    assert any("error" in result for result in webui)  # the set reaches the not-a-number case
    differing = [(p, w, _ours(p)) for p, w in zip(prompts, webui) if _ours(p) != w]
    assert not differing, "\n".join(f"{p!r}: WebUI {w} ours {o}" for p, w, o in differing[:10])


# -- chunks -----------------------------------------------------------------------------------

START, END, COMMA = 49406, 49407, 267


def _bodies(chunks: list) -> list[list[int]]:
    """Each chunk's 75 body ids with the padding stripped (after checking the frame)."""
    bodies = []
    for chunk in chunks:
        assert len(chunk.tokens) == len(chunk.weights) == CHUNK_LENGTH + 2
        assert chunk.tokens[0] == START and chunk.tokens[-1] == END
        body = chunk.tokens[1:-1]
        while body and body[-1] == END:
            body.pop()
        bodies.append(body)
    return bodies


def test_an_empty_prompt_is_one_chunk_of_padding() -> None:
    (chunk,) = chunk_tokens([([], 1.0)], START, END, COMMA)
    assert chunk.tokens == [START] + [END] * 76 and chunk.weights == [1.0] * 77


def test_chunks_hold_75_tokens() -> None:
    assert _bodies(chunk_tokens([(list(range(1, 76)), 1.0)], START, END, COMMA)) == [list(range(1, 76))]
    assert _bodies(chunk_tokens([(list(range(1, 77)), 1.0)], START, END, COMMA)) == [list(range(1, 76)), [76]]
    assert len(chunk_tokens([(list(range(1, 151)), 1.0)], START, END, COMMA)) == 2
    assert len(chunk_tokens([(list(range(1, 152)), 1.0)], START, END, COMMA)) == 3


def test_words_after_a_late_comma_move_to_the_next_chunk() -> None:
    words = list(range(1, 61)) + [COMMA] + list(range(100, 130))  # comma at index 60: 15 from the end
    first, second = _bodies(chunk_tokens([(words, 1.0)], START, END, COMMA))
    assert first == list(range(1, 61)) + [COMMA]
    assert second == list(range(100, 130))
    early = list(range(1, 55)) + [COMMA] + list(range(100, 130))  # comma at index 54: 21 from the end
    first, second = _bodies(chunk_tokens([(early, 1.0)], START, END, COMMA))
    assert first == early[:75] and second == early[75:]
    nothing_to_move = list(range(1, 61)) + [COMMA] + list(range(100, 130))
    first, _ = _bodies(chunk_tokens([(nothing_to_move, 1.0)], START, END, None))
    assert len(first) == 75  # without a comma id no words move


def test_a_comma_arriving_at_a_full_chunk_starts_the_next() -> None:
    words = list(range(1, 71)) + [COMMA] + list(range(200, 204)) + [COMMA, 300]  # 2nd comma is the 76th
    first, second = _bodies(chunk_tokens([(words, 1.0)], START, END, COMMA))
    assert first == words[:75] and second == [COMMA, 300]


def test_moved_words_keep_their_weights() -> None:
    pieces = [(list(range(1, 66)) + [COMMA], 1.0), ([7, 8, 9, 10, 11, 12, 13, 14, 15, 16], 1.5)]
    first, second = chunk_tokens(pieces, START, END, COMMA)
    assert first.weights[1:67] == [1.0] * 66 and first.weights[67:] == [1.0] * 10
    assert second.tokens[1:11] == list(range(7, 17)) and second.weights[1:11] == [1.5] * 10


@pytest.mark.parametrize(
    ("pieces", "bodies"),
    [
        ([([1], 1.0), (None, -1.0), ([2], 1.0)], [[1], [2]]),
        ([([1], 1.0), (None, -1.0)], [[1]]),
        ([(None, -1.0), ([2], 1.0)], [[], [2]]),
        ([([1], 1.0), (None, -1.0), (None, -1.0), ([2], 1.0)], [[1], [], [2]]),
        ([(None, -1.0)], [[]]),
        ([(list(range(1, 76)), 1.0), (None, -1.0), ([2], 1.0)], [list(range(1, 76)), [2]]),
    ],
)
def test_break_ends_the_chunk(pieces: list, bodies: list) -> None:
    assert _bodies(chunk_tokens(pieces, START, END, COMMA)) == bodies


# -- the encoder: weights per token, BREAK, padding --------------------------------------------


class _KnownEncoder(torch.nn.Module):
    """Stands in for a CLIP text encoder: the hidden state of id t at position p is (t, p + 1, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False) -> SimpleNamespace:
        self.seen.append(input_ids[0].tolist())
        ids = input_ids.to(torch.float64)
        positions = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64).expand_as(ids)
        hidden = torch.stack([ids, positions, torch.ones_like(ids)], dim=-1)
        return SimpleNamespace(last_hidden_state=hidden, hidden_states=(hidden,), text_embeds=None)


def _expected(ids: list[int], weights: list[float]) -> torch.Tensor:
    ids_t = torch.tensor(ids, dtype=torch.float64)
    hidden = torch.stack([ids_t, torch.arange(1, 78, dtype=torch.float64), torch.ones(77, dtype=torch.float64)], -1)
    weighted = hidden * torch.tensor(weights, dtype=torch.float64)[:, None]
    return (weighted * (hidden.mean() / weighted.mean()))[None]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("tokenizer")
    return {"clip": clip_tokenizer(folder=folder), "openclip": clip_tokenizer("!", folder=folder)}


def test_each_token_gets_its_weight_and_the_mean_is_restored(tokenizers: dict) -> None:
    tokenizer, encoder = tokenizers["clip"], _KnownEncoder()
    got = PromptEncoder([tokenizer], [encoder], [{}]).encode("a (photo:1.5) of [horse]").embeds
    a, photo, of, horse = 320, 1125, 539, 4558  # CLIP's ids for these words
    ids = [START, a, photo, of, horse] + [END] * 72
    assert encoder.seen == [ids]
    expected = _expected(ids, [1.0, 1.0, 1.5, 1.0, 1 / 1.1] + [1.0] * 72)
    assert torch.allclose(got.to(torch.float64), expected, rtol=1e-12, atol=0)


class _WideEncoder(torch.nn.Module):
    """Random float32 vectors as wide as SD 1.5's (768), a fixed function of the ids."""

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False) -> SimpleNamespace:
        rows = torch.Generator().manual_seed(int(input_ids.sum()))
        hidden = torch.randn((*input_ids.shape, 768), generator=rows) * 3 + 0.25
        return SimpleNamespace(last_hidden_state=hidden, hidden_states=(hidden,), text_embeds=None)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="two cores")
def test_weighted_conditioning_is_the_same_bytes_on_one_thread_and_on_two(tokenizers: dict) -> None:
    """The mean restoration sums 77 x 768 values: PyTorch's own mean splits that sum by thread, so a batch worker
    on one thread got other bytes than a process on every core (and pictures 1/255 apart)."""
    encoder = PromptEncoder([tokenizers["clip"]], [_WideEncoder()], [{}])
    # PyTorch's mean differs between 1 and 2 threads on about half of such tensors: eight prompts
    prompts = [f"a (photo:1.{n}) of [horse], (golden hour:1.2) {'very ' * n}far" for n in range(1, 9)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [encoder.encode(prompt).embeds for prompt in prompts]
        torch.set_num_threads(2)
        two = [encoder.encode(prompt).embeds for prompt in prompts]
    finally:
        torch.set_num_threads(threads)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(one, two))
    assert not torch.equal(one[0], _WideEncoder()(torch.zeros(1, 77, dtype=torch.long)).last_hidden_state)


def test_break_and_the_negative_padded_with_empty_chunks(tokenizers: dict) -> None:
    tokenizer, encoder = tokenizers["clip"], _KnownEncoder()
    cond, uncond = PromptEncoder([tokenizer], [encoder], [{}]).encode_pair("a BREAK (horse)", "photo")
    assert cond.chunks == uncond.chunks == 2
    empty = [START] + [END] * 76
    assert encoder.seen == [
        [START, 320] + [END] * 75, [START, 4558] + [END] * 75,  # the prompt, cut at BREAK
        [START, 1125] + [END] * 75,  # the negative prompt
        empty,  # the chunk it is padded with
    ]
    assert torch.allclose(uncond.embeds[:, 77:].to(torch.float64), _expected(empty, [1.0] * 77), rtol=1e-12)
    horse = _expected([START, 4558] + [END] * 75, [1.0, 1.1] + [1.0] * 75)
    assert torch.allclose(cond.embeds[:, 77:].to(torch.float64), horse, rtol=1e-12)


def test_openclip_pads_after_the_first_end_token(tokenizers: dict) -> None:
    tokenizer, encoder = tokenizers["openclip"], _KnownEncoder()
    PromptEncoder([tokenizer], [encoder], [{}]).encode("a horse")
    assert encoder.seen == [[START, 320, 4558, END] + [0] * 73]
