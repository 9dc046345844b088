"""The extension in the real WebUI's page, in headless Chromium: the panel, paste-back, a generation.

Runs after the HTTP tests on the same WebUI (``webui`` fixture). Needs Debian's chromium and
chromedriver and selenium (``.ci/browser-setup``); skipped with the reason without them.

The first test takes the pictures of the txt2img tab the docs show (``panel.png``: the dropdown entry
with its panel; ``section.png``: the always-on section opened and enabled) into ``pictures/`` in the
test's log folder (beside the WebUI's log). ``OV_DOCS_PICTURES=docs`` copies them into ``docs/`` as well
(any other value: that folder, relative to the checkout). To refresh the docs' pictures, run this file
alone, so the WebUI is fresh and "Last run" reads "No generation with OpenVINO yet":

    OV_DOCS_PICTURES=docs OV_REAL_WEBUI=require .venv/bin/python -m pytest -q \
        tests/real_webui/test_real_webui_browser.py -k pictures
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .webui import ROOT, WebUI

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
    pytest.skip("chromium/chromedriver not installed: run .ci/browser-setup", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: run .ci/browser-setup")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from .browser import (  # noqa: E402
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


@pytest.fixture(scope="module")
def page(webui: WebUI) -> Iterator[Any]:
    options = chrome_options(webdriver, CHROMIUM, WINDOW)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.get(webui.url)
        WebDriverWait(driver, 300).until(lambda d: d.execute_script(
            "return !!document.querySelector('#txt2img_prompt textarea') && !!document.getElementById('"
            + PANEL + "_panel')"))
        # the WebUI's own page scripts loaded (gradio answers 403 for files it will not serve)
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(
            "return typeof submit === 'function' && typeof onUiLoaded === 'function'"))
        yield driver
    finally:
        driver.quit()


def test_pictures_of_the_panel_and_the_section(page: Any, webui: WebUI) -> None:
    """The dropdown entry's panel and the always-on section as a user finds them in txt2img, each control
    shown (device, parts, the three precisions with INT8, cache, pre-compile, status), and their pictures."""
    out = webui.log_dir / "pictures"
    out.mkdir(parents=True, exist_ok=True)
    page.set_window_size(*PICTURE_WINDOW)
    was_enabled = section_enabled(page)  # Settings -> OpenVINO -> Enable for every generation
    try:
        # the dropdown entry, picked in the Script dropdown: its panel opens under it
        assert script_choice(page) == "None" and not panel_visible(page)
        choose_script(page, TITLE)
        WebDriverWait(page, 60).until(panel_visible)
        set_text(page, f"#{PANEL}_cache_dir textarea", PICTURE_CACHE_DIR)
        page.find_element(By.ID, f"{PANEL}_refresh").click()
        WebDriverWait(page, 180).until(lambda d: PICTURE_CACHE_DIR in js(
            d, f"return document.querySelector('#{PANEL}_cache_size textarea').value"))
        seen = controls(page, PANEL)
        assert_panel_shown(seen)
        js(page, "document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0)")
        panel = picture(page, ["#txt2img_script_container #script_list", f"#{PANEL}_panel"], out / "panel.png")

        # the always-on section: its accordion opened, Enable ticked
        choose_script(page, "None")
        WebDriverWait(page, 60).until(lambda d: not panel_visible(d))
        page.find_element(By.CSS_SELECTOR, f"#{SECTION}_accordion .label-wrap").click()
        WebDriverWait(page, 60).until(lambda d: js(
            d, f"return document.getElementById('{SECTION}_panel').offsetParent !== null"))
        if not was_enabled:
            page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()
        WebDriverWait(page, 60).until(section_enabled)
        set_text(page, f"#{SECTION}_cache_dir textarea", PICTURE_CACHE_DIR)
        page.find_element(By.ID, f"{SECTION}_refresh").click()
        WebDriverWait(page, 180).until(lambda d: PICTURE_CACHE_DIR in js(
            d, f"return document.querySelector('#{SECTION}_cache_size textarea').value"))
        seen = controls(page, SECTION)
        assert_panel_shown(seen)
        assert js(page, f"return document.querySelector('#{SECTION}_enabled').innerText").startswith("Enable")
        js(page, "document.activeElement && document.activeElement.blur()")
        section = picture(page, [f"#{SECTION}_accordion"], out / "section.png")
    except Exception:
        page.save_screenshot(str(out / "failed-page.png"))  # what the page showed, for the report
        raise
    finally:
        # back to how the other tests expect the page: no script, the section as it was and closed, default
        # cache folders (nothing is ever written in PICTURE_CACHE_DIR)
        for prefix in (PANEL, SECTION):
            set_text(page, f"#{prefix}_cache_dir textarea", "")
        if section_enabled(page) != was_enabled:
            page.find_element(By.CSS_SELECTOR, f"#{SECTION}_enabled input").click()
        if js(page, f"return document.getElementById('{SECTION}_panel').offsetParent !== null"):
            page.find_element(By.CSS_SELECTOR, f"#{SECTION}_accordion .label-wrap").click()
        if script_choice(page) != "None":
            choose_script(page, "None")
        page.set_window_size(*WINDOW)
    assert section_enabled(page) == was_enabled and script_choice(page) == "None"
    assert js(page, f"return document.querySelector('#{PANEL}_cache_dir textarea').value") == ""

    for image in (panel, section):
        assert_readable_picture(image, PICTURE_WINDOW[0])
    target = os.environ.get("OV_DOCS_PICTURES")
    if target:
        folder = ROOT / target
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("panel.png", "section.png"):
            shutil.copyfile(out / name, folder / name)


def test_paste_back_selects_the_script_and_restores_the_panel(page: Any) -> None:
    assert script_choice(page) == "None" and not panel_visible(page)
    paste(page, 'a red car\nNegative prompt: blurry\nSteps: 3, Sampler: Euler, CFG scale: 5, Seed: 7, Size: 64x64, '
                'Script: Accelerate with OpenVINO, OpenVINO: "CPU, UNet+TE, f32"')
    WebDriverWait(page, 60).until(lambda d: script_choice(d) == TITLE)
    WebDriverWait(page, 60).until(lambda d: panel_visible(d) and precision(d) == "Full precision (f32)")
    assert checkbox(page, "unet") and checkbox(page, "text_encoder") and not checkbox(page, "vae")
    assert js(page, "return document.querySelector('#txt2img_steps input').value") == "3"

    paste(page, 'a blue car\nSteps: 4, Seed: 8, Size: 64x64, Script: Accelerate with OpenVINO, '
                'OpenVINO: "CPU, UNet+VAE+TE, auto"')
    WebDriverWait(page, 60).until(lambda d: precision(d) == "Automatic (fastest the device supports)")
    assert checkbox(page, "unet") and checkbox(page, "vae") and checkbox(page, "text_encoder")


def test_generate_in_the_page_shows_the_status_under_the_images(page: Any, webui: WebUI) -> None:
    paste(page, 'a yellow boat on a lake\nNegative prompt: blurry\nSteps: 3, Sampler: Euler, CFG scale: 5, Seed: 11, '
                'Size: 64x64, Script: Accelerate with OpenVINO, OpenVINO: "CPU, UNet+VAE+TE, f32"')
    WebDriverWait(page, 60).until(lambda d: script_choice(d) == TITLE and precision(d) == "Full precision (f32)")
    page.find_element(By.CSS_SELECTOR, "#txt2img_generate").click()
    # A1111 shows the infotext in html_info and the run's comments (our status) in html_log
    log = WebDriverWait(page, 600).until(lambda d: js(
        d, "const e = document.querySelector('#html_log_txt2img'); "
           "return e && e.innerText.includes('OpenVINO (') ? e.innerText : null"))
    assert "Nothing fell back to PyTorch" in log or "No new compile" in log, log
    info = js(page, "return document.querySelector('#html_info_txt2img').innerText")
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in info and "a yellow boat on a lake" in info, info
    assert js(page, "return document.querySelectorAll('#txt2img_gallery img').length") >= 1
    status = webui.status()
    assert status["accelerated"] and status["eager_calls"] == 0 and status["ov_calls"] > 0, status


def test_paste_back_enables_the_section_and_a_generation_goes_through_it(page: Any, webui: WebUI) -> None:
    paste(page, 'a green tram in the city\nNegative prompt: blurry\nSteps: 3, Sampler: Euler, CFG scale: 5, Seed: 9, '
                'Size: 64x64, OpenVINO: "CPU, UNet+VAE+TE, f32", OpenVINO section: on')
    WebDriverWait(page, 60).until(lambda d: section_enabled(d) and js(
        d, f"const e = document.querySelector('#{SECTION}_precision input:checked'); return e && e.value")
        == "Full precision (f32)")
    assert script_choice(page) == "None"  # made by the section: no dropdown script
    page.find_element(By.CSS_SELECTOR, "#txt2img_generate").click()
    info = WebDriverWait(page, 600).until(lambda d: js(
        d, "const e = document.querySelector('#html_info_txt2img'); "
           "return e && e.innerText.includes('a green tram') ? e.innerText : null"))
    log = js(page, "return document.querySelector('#html_log_txt2img').innerText")
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in info and "OpenVINO section: on" in info, info
    assert "OpenVINO (CPU, UNet+VAE+TE, f32)" in log, log
    status = webui.status()
    assert status["accelerated"] and status["eager_calls"] == 0 and status["ov_calls"] > 0, status

    paste(page, "a green tram in the city\nSteps: 3, Seed: 9, Size: 64x64")  # a stock image: the default (off)
    WebDriverWait(page, 60).until(lambda d: not section_enabled(d))
