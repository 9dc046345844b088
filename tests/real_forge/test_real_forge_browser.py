"""The extension in Forge's page (gradio 4.40; A1111's is 3.41), in headless Chromium: the dropdown entry's panel,
the always-on "OpenVINO" section, a generation made from the page through the section, paste-back, and neither a
JavaScript error of the extension in the browser's console nor an error of it in Forge's log.

A Forge of its own with its UI (``forge_ui`` in conftest.py, for this module: the other modules' ``forge`` runs API
only), on the tier's cheap SD 1.5 checkpoint, with this project cloned into its ``extensions/``; its log, the
browser's console (``browser-console.log``) and the pictures are in its log folder. Needs Debian's
chromium and chromedriver and selenium (``.ci/browser-setup``); skipped with the reason without them, as
``tests/real_webui/test_real_webui_browser.py`` (A1111's page; the helpers both use are in
``tests/real_webui/browser.py``).

The first two tests take pictures of the txt2img tab into ``pictures/`` in the module's log folder: ``panel.png``
(the Script dropdown with the entry chosen and its panel) and ``section.png`` (the section opened and enabled).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_webui.webui import EXTENSION_NAME, psnr

from .forge import Forge, assert_accelerated
from .test_real_forge import request
from .test_real_forge_accelerate import MIN_AUTO_DB, fresh

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
    pytest.skip("chromium/chromedriver not installed: run .ci/browser-setup", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: run .ci/browser-setup")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.real_webui.browser import (  # noqa: E402
    PANEL,
    PICTURE_CACHE_DIR,
    PICTURE_WINDOW,
    SECTION,
    TITLE,
    WINDOW,
    assert_panel_shown,
    assert_readable_picture,
    checkbox,
    choose_script,
    chrome_options,
    controls,
    js,
    panel_visible,
    paste,
    picture,
    precision,
    script_choice,
    section_enabled,
    set_text,
)

STEP_CACHE_CHOICES = ["Off", "Every 2 steps", "Every 3 steps", "Every 4 steps"]
NO_RUN_YET = "No generation with OpenVINO yet."
PROMPT = "a yellow boat on a lake"
COUNT_CALLS = """
    window.ovtestCalls = 0;  // the page's calls of gradio's event queue, one for each event sent to the server
    const fetchOriginal = window.fetch;
    window.fetch = function(url) {
        if (String(url).includes('/queue/join')) { window.ovtestCalls += 1; }
        return fetchOriginal.apply(this, arguments);
    };"""
"""Counts the page's event calls (gradio 4 sends each event to ``/queue/join``), from before the page's own code."""
EXTENSION_MARKS = (EXTENSION_NAME, "ov_accelerate", "ov_backend")
"""What names this extension in a traceback of Forge's log: its folder and its packages."""


@pytest.fixture(scope="module")
def page(forge_ui: Forge) -> Iterator[Any]:
    options = chrome_options(webdriver, CHROMIUM, WINDOW)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read by the last test
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": COUNT_CALLS})
        driver.get(forge_ui.url)
        WebDriverWait(driver, 300).until(lambda d: d.execute_script(
            "return !!document.querySelector('#txt2img_prompt textarea') && !!document.getElementById('"
            + PANEL + "_panel')"))
        # Forge's own page scripts and the extension's loaded (gradio answers 403 for files it will not serve)
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(
            "return typeof submit === 'function' && typeof onUiLoaded === 'function' "
            "&& typeof ovAccelerate === 'object'"))
        yield driver
    finally:
        driver.quit()


def textbox(driver: Any, elem_id: str) -> str:
    return js(driver, f"return document.querySelector('#{elem_id} textarea').value")


def step_cache_choices(driver: Any, prefix: str) -> list[str]:
    return js(driver, f"return [...document.querySelectorAll('#{prefix}_step_cache label')]"
                      ".map(l => l.innerText.trim())")


def section_shown(driver: Any) -> bool:
    return js(driver, f"return document.getElementById('{SECTION}_panel').offsetParent !== null")


def type_number(driver: Any, elem_id: str, value: int) -> None:
    """Types ``value`` into a slider's number box as a user does (select all, type, leave with Tab)."""
    box = driver.find_element(By.CSS_SELECTOR, f"#{elem_id} input[type=number]")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(str(value), Keys.TAB)


def number(driver: Any, elem_id: str) -> str:
    return js(driver, f"return document.querySelector('#{elem_id} input[type=number]').value")


def quiet(driver: Any, seconds: float = 3.0, timeout: float = 30.0) -> None:
    """Waits until the page sends no event to the server for ``seconds``; fails when it never stops."""
    t0 = time.time()
    calls = js(driver, "return window.ovtestCalls")
    since = time.time()
    while time.time() - since < seconds:
        assert time.time() - t0 < timeout, (
            f"the page went on calling the server while nothing happened: {js(driver, 'return window.ovtestCalls')} "
            f"calls since it loaded, still coming after {timeout:.0f} s")
        time.sleep(0.5)
        now = js(driver, "return window.ovtestCalls")
        if now != calls:
            calls, since = now, time.time()


def error_reports(log: str) -> list[str]:
    """Each error a log reports: a line naming an error ("Error", "Traceback") with the traceback under it (the
    indented lines and the exception's own line)."""
    lines = log.splitlines()
    reports = []
    i = 0
    while i < len(lines):
        end = i + 1
        if "Error" in lines[i] or "Traceback" in lines[i]:
            while end < len(lines) and (lines[end][:1].isspace()
                                        or re.match(r"[\w.]+(Error|Exception)\b", lines[end])):
                end += 1
            reports.append("\n".join(lines[i:end]))
        i = end
    return reports


def test_dropdown_entry_shows_its_panel(page: Any, forge_ui: Forge) -> None:
    """The Script dropdown lists the entry; chosen, its panel shows every control (device with its full name, the
    three parts, the four precisions, step caching, disk cache, pre-compile, Last run), its hints (the extension's
    JavaScript), and its buttons answer: Clear cache asks first, Refresh reads another cache folder."""
    out = forge_ui.log_dir / "pictures"
    out.mkdir(parents=True, exist_ok=True)
    page.set_window_size(*PICTURE_WINDOW)
    try:
        assert script_choice(page) == "None" and not panel_visible(page)
        choose_script(page, TITLE)
        WebDriverWait(page, 60).until(panel_visible)
        seen = controls(page, PANEL)
        assert_panel_shown(seen)
        assert step_cache_choices(page, PANEL) == STEP_CACHE_CHOICES
        assert textbox(page, f"{PANEL}_status") == NO_RUN_YET
        hint = js(page, f"return document.querySelector('#{PANEL}_device span[data-testid=\"block-info\"]').title")
        assert hint.startswith("Where the accelerated parts run"), hint
        assert page.find_element(By.ID, f"{PANEL}_refresh").get_attribute("title").startswith("Update the cache size")

        js(page, "window.ovtestConfirms = []; window.confirm = (m) => { ovtestConfirms.push(m); return false; }")
        page.find_element(By.ID, f"{PANEL}_clear_cache").click()  # declined: nothing deleted
        WebDriverWait(page, 120).until(lambda d: textbox(d, f"{PANEL}_cache_size").startswith("Not cleared"))
        assert js(page, "return ovtestConfirms.length") == 1, js(page, "return ovtestConfirms")
        set_text(page, f"#{PANEL}_cache_dir textarea", PICTURE_CACHE_DIR)
        page.find_element(By.ID, f"{PANEL}_refresh").click()
        WebDriverWait(page, 120).until(lambda d: PICTURE_CACHE_DIR in textbox(d, f"{PANEL}_cache_size"))

        js(page, "document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0)")
        image = picture(page, ["#txt2img_script_container #script_list", f"#{PANEL}_panel"], out / "panel.png")
    except Exception:
        page.save_screenshot(str(out / "failed-page.png"))  # what the page showed, for the report
        raise
    finally:  # no script and the default cache folder, as the page opened
        set_text(page, f"#{PANEL}_cache_dir textarea", "")
        if script_choice(page) != "None":
            choose_script(page, "None")
        page.set_window_size(*WINDOW)
    assert not panel_visible(page) and textbox(page, f"{PANEL}_cache_dir") == ""
    assert_readable_picture(image, PICTURE_WINDOW[0])


def test_section_opens_with_its_controls(page: Any, forge_ui: Forge) -> None:
    """The always-on "OpenVINO" accordion is closed at first; opened, it shows its Enable checkbox (off by default)
    and the panel's controls."""
    out = forge_ui.log_dir / "pictures"
    out.mkdir(parents=True, exist_ok=True)
    page.set_window_size(*PICTURE_WINDOW)
    try:
        assert not section_shown(page) and not section_enabled(page)
        page.find_element(By.CSS_SELECTOR, f"#{SECTION}_accordion .label-wrap").click()
        WebDriverWait(page, 60).until(section_shown)
        enable = js(page, f"return document.querySelector('#{SECTION}_enabled').innerText.trim()")
        assert enable.startswith("Enable: run this generation's UNet, VAE and text encoder in OpenVINO"), enable
        page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()
        WebDriverWait(page, 60).until(section_enabled)
        seen = controls(page, SECTION)
        assert_panel_shown(seen)
        assert step_cache_choices(page, SECTION) == STEP_CACHE_CHOICES
        assert textbox(page, f"{SECTION}_status") == NO_RUN_YET
        set_text(page, f"#{SECTION}_cache_dir textarea", PICTURE_CACHE_DIR)
        page.find_element(By.ID, f"{SECTION}_refresh").click()
        WebDriverWait(page, 120).until(lambda d: PICTURE_CACHE_DIR in textbox(d, f"{SECTION}_cache_size"))
        js(page, "document.activeElement && document.activeElement.blur()")
        image = picture(page, [f"#{SECTION}_accordion"], out / "section.png")
    except Exception:
        page.save_screenshot(str(out / "failed-page.png"))
        raise
    finally:  # closed, off and on the default cache folder again, as the page opened
        set_text(page, f"#{SECTION}_cache_dir textarea", "")
        if section_enabled(page):
            page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()
        if section_shown(page):
            page.find_element(By.CSS_SELECTOR, f"#{SECTION}_accordion .label-wrap").click()
        page.set_window_size(*WINDOW)
    WebDriverWait(page, 60).until(lambda d: not section_shown(d) and not section_enabled(d))
    assert textbox(page, f"{SECTION}_cache_dir") == ""
    assert_readable_picture(image, PICTURE_WINDOW[0])


@pytest.fixture(scope="module")
def generation(page: Any, forge_ui: Forge) -> dict[str, Any]:
    """A generation made from the page as a user makes it: the section opened and enabled, Full precision (f32)
    chosen, 64x64 and 3 steps typed in, a prompt, Generate. What the page and the status route then show."""
    page.find_element(By.CSS_SELECTOR, f"#{SECTION}_accordion .label-wrap").click()
    WebDriverWait(page, 60).until(section_shown)
    if not section_enabled(page):
        page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()
    page.find_element(By.CSS_SELECTOR, f"#{SECTION}_precision input[value='Full precision (f32)']").click()
    for name, value in (("txt2img_width", 64), ("txt2img_height", 64), ("txt2img_steps", 3)):
        type_number(page, name, value)
    assert [number(page, name) for name in ("txt2img_width", "txt2img_height", "txt2img_steps")] == ["64", "64", "3"]
    page.find_element(By.CSS_SELECTOR, "#txt2img_prompt textarea").send_keys(PROMPT)
    assert textbox(page, f"{SECTION}_cache_dir") == ""  # the default cache, in the test's data folder
    WebDriverWait(page, 60).until(lambda d: section_enabled(d) and js(
        d, f"return document.querySelector('#{SECTION}_precision input:checked').value") == "Full precision (f32)")
    page.find_element(By.CSS_SELECTOR, "#txt2img_generate").click()
    info = WebDriverWait(page, 900).until(lambda d: js(
        d, "const e = document.querySelector('#html_info_txt2img'); "
           f"return e && e.innerText.includes('{PROMPT}') ? e.innerText : null"))
    # "Last run" follows the generation by itself (no Refresh)
    WebDriverWait(page, 60).until(lambda d: textbox(d, f"{SECTION}_status") != NO_RUN_YET)
    return {
        "info": info,
        "log": js(page, "return document.querySelector('#html_log_txt2img').innerText"),
        "last_run": textbox(page, f"{SECTION}_status"),
        "images": js(page, "return [...document.querySelectorAll('#txt2img_gallery img')]"
                           ".map(i => [i.naturalWidth, i.naturalHeight])"),
        "status": forge_ui.status(),
    }


def test_generation_from_the_page_runs_through_openvino(page: Any, forge_ui: Forge,
                                                       generation: dict[str, Any]) -> None:
    """The generation finishes with a 64x64 picture; the infotext records the section's settings, the text under
    the images and the section's "Last run" say it ran in OpenVINO with nothing in PyTorch, and so does the status
    route. Afterwards the page sends nothing to the server (the refresh of "Last run" fires once)."""
    assert generation["images"] and all(size == [64, 64] for size in generation["images"]), generation["images"]
    info = generation["info"]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in info and "OpenVINO section: on" in info, info
    assert "Steps: 3," in info and "Size: 64x64" in info, info
    for text in (generation["log"], generation["last_run"]):
        assert text.startswith("OpenVINO (CPU, UNet+VAE+TE, f32)"), text
        assert "Nothing fell back to PyTorch" in text and ", 0 PyTorch calls" in text, text
    status = generation["status"]
    assert status["settings"] == "CPU, UNet+VAE+TE, f32", status["settings"]
    assert_accelerated(status)
    quiet(page)


def test_paste_back_restores_the_section_and_the_panel(page: Any, generation: dict[str, Any]) -> None:
    """The generation's infotext, pasted into the prompt box and read with the paste button, turns the section on at
    f32 again (and the size and steps); an infotext of the dropdown entry chooses the entry and sets its panel (the
    section off: that image was not made by it); a stock one leaves both off."""
    page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()  # off, Automatic, other size and steps
    page.find_element(By.CSS_SELECTOR,
                      f"#{SECTION}_precision input[value='Automatic (fastest the device supports)']").click()
    for name, value in (("txt2img_width", 512), ("txt2img_height", 512), ("txt2img_steps", 20)):
        type_number(page, name, value)
    WebDriverWait(page, 60).until(lambda d: not section_enabled(d) and number(d, "txt2img_steps") == "20")

    paste(page, generation["info"])
    WebDriverWait(page, 60).until(lambda d: section_enabled(d) and js(
        d, f"return document.querySelector('#{SECTION}_precision input:checked').value") == "Full precision (f32)")
    WebDriverWait(page, 60).until(lambda d: [number(d, n) for n in ("txt2img_width", "txt2img_height", "txt2img_steps")]
                                  == ["64", "64", "3"])
    assert script_choice(page) == "None"  # made by the section: no dropdown script

    paste(page, 'a red car\nNegative prompt: blurry\nSteps: 3, Sampler: Euler, CFG scale: 5, Seed: 7, Size: 64x64, '
                'Script: Accelerate with OpenVINO, OpenVINO: "CPU, UNet+TE, f32"')
    WebDriverWait(page, 60).until(lambda d: script_choice(d) == TITLE)
    WebDriverWait(page, 60).until(lambda d: panel_visible(d) and precision(d) == "Full precision (f32)")
    assert checkbox(page, "unet") and checkbox(page, "text_encoder") and not checkbox(page, "vae")
    assert not section_enabled(page)

    paste(page, "a red car\nSteps: 3, Seed: 7, Size: 64x64")  # a stock image: no script, the section off
    WebDriverWait(page, 60).until(lambda d: script_choice(d) == "None" and not panel_visible(d))
    assert not section_enabled(page)


def test_no_errors_from_the_extension(page: Any, forge_ui: Forge) -> None:
    """Nothing in the browser's console from the extension's JavaScript (its file, its calls), no error of the
    extension in Forge's log, and the page quiet when nothing happens. The console is kept in the log folder."""
    quiet(page)
    console = page.get_log("browser")  # everything since the page opened
    (forge_ui.log_dir / "browser-console.log").write_text(
        "".join(f"{e['level']} {e['source']} {e['message']}\n" for e in console))
    ours = [e for e in console if e["level"] in ("SEVERE", "WARNING")
            and re.search(r"openvino|ovAccelerate", e["message"], re.IGNORECASE)]
    assert not ours, ours
    reports = [r for r in error_reports(forge_ui.log_text()) if any(mark in r for mark in EXTENSION_MARKS)]
    assert not reports, "\n\n".join(reports)


def test_xyz_plot_over_the_openvino_enabled_axis(forge_ui: Forge) -> None:
    """The extension's X/Y/Z axes are in Forge's X/Y/Z plot; with the section off, the "[OpenVINO] Enabled" axis
    alone accelerates the On cell, and the Off cell is stock Forge's. (Over HTTP, on this module's Forge: the axes
    are added before the page is built, by the ``before_ui`` callback, and an API-only Forge, as A1111, builds its
    scripts' arguments before it calls that.)"""
    info = next(s for s in forge_ui.get("/sdapi/v1/script-info") if s["name"] == "x/y/z plot" and not s["is_img2img"])
    args = [arg["value"] for arg in info["args"]]
    for i, arg in enumerate(info["args"]):
        if arg["label"] in ("X type", "Y type", "Z type"):
            args[i] = arg["choices"].index("[OpenVINO] Enabled" if arg["label"] == "X type" else "Nothing")
        elif arg["label"] == "Include Sub Images":  # each cell's picture after the grid
            args[i] = True
    x_type = next(a for a in info["args"] if a["label"] == "X type")
    for axis in ("[OpenVINO] Precision", "[OpenVINO] Device", "[OpenVINO] Step caching"):
        assert axis in x_type["choices"], x_type["choices"]
    args[1], args[2] = "", ["On", "Off"]  # X values, and X's dropdown values
    stock = forge_ui.generate(fresh(request("a teapot on a table")))
    grid = forge_ui.generate(fresh(dict(request("a teapot on a table"), script_name="x/y/z plot", script_args=args)))
    status = forge_ui.status()
    assert_accelerated(status, ("UNet", "VAE"))
    assert status["generations"] == 1 and status["plain_generations"] == 1, status["status"]
    on, off = grid.images[1], grid.images[2]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, auto"' in grid.infotexts[1], grid.infotexts[1]
    assert "OpenVINO" not in grid.infotexts[2], grid.infotexts[2]
    for cell, what in ((on, "On"), (off, "Off")):
        value = psnr(cell, stock.images[0])
        forge_ui.record(f"forge: X/Y/Z [OpenVINO] Enabled, the {what} cell against stock", value)
        assert value >= MIN_AUTO_DB, (what, value)
