"""``python -m bench batch``'s report, on pictures made here (a unit test: it runs in CI, unlike the bench's own
end-to-end run in ``test_batch_bench.py``)."""

from __future__ import annotations

from pathlib import Path


def test_a_mode_whose_pictures_match_the_command_lines_is_reported_identical(tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    from bench.batch import markdown, summarize

    def png(name: str, value: int) -> str:
        path = tmp_path / name
        pixels = np.full((8, 8, 3), 100, dtype=np.uint8)
        pixels[0, 0, 0] = value
        Image.fromarray(pixels).save(path)
        return str(path)

    reference = {"mode": "cli", "images": [png("a.png", 100), png("b.png", 100)]}
    same = summarize({"mode": "workers2", "came": [1.0, 2.0], "seconds": 2.0, "memory_gib": 1.0,
                      "images": [png("c.png", 100), png("d.png", 100)]}, reference)
    apart = summarize({"mode": "ray2", "came": [1.0, 2.0], "seconds": 2.0, "memory_gib": 1.0,
                       "images": [png("e.png", 100), png("f.png", 101)]}, reference)
    assert same["identical_to_cli"] and same["psnr_vs_cli"] == 99.0 and not apart["identical_to_cli"]
    assert 60 < apart["psnr_vs_cli"] < 99
    results = {"settings": {"images": 2, "size": 8, "steps": 1, "precision": "f32", "model": "m"}, "cpu": {},
               "started": "2026-11-28T00:00:00", "command": "c", "machine": {}, "available_gib_at_start": 1,
               "rows": [same, apart]}
    table = markdown(results)
    assert "| workers2 |" in table and "identical pixels" in table.split("| workers2 |")[1].splitlines()[0]
    assert f"| {apart['psnr_vs_cli']} |" in table.split("| ray2 |")[1].splitlines()[0]
