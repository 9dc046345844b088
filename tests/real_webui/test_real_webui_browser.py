"""The extension in the real WebUI's page, in headless Chromium: the panel, paste-back, a generation.

Runs after the HTTP tests on the same WebUI (``webui`` fixture). Needs Debian's chromium and
chromedriver and selenium (``.ci/browser-setup``); skipped with the reason without them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .webui import WebUI

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
    pytest.skip("chromium/chromedriver not installed: run .ci/browser-setup", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: run .ci/browser-setup")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PANEL = "script_txt2img_accelerate_with_openvino"
TITLE = "Accelerate with OpenVINO"


@pytest.fixture(scope="module")
def page(webui: WebUI) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,2000",
                "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"):
        options.add_argument(arg)
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


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def script_choice(driver: Any) -> str:
    return js(driver, "return document.querySelector('#txt2img_script_container #script_list input').value")


def checkbox(driver: Any, field: str) -> bool:
    return js(driver, f"return document.querySelector('#{PANEL}_{field} input').checked")


def precision(driver: Any) -> str:
    return js(driver, f"const e = document.querySelector('#{PANEL}_precision input:checked'); return e && e.value")


def panel_visible(driver: Any) -> bool:
    return js(driver, f"return document.getElementById('{PANEL}_panel').offsetParent !== null")


def paste(driver: Any, text: str) -> None:
    box = driver.find_element(By.CSS_SELECTOR, "#txt2img_prompt textarea")
    js(driver, "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input', {bubbles: true}))",
       box, text)
    driver.find_element(By.CSS_SELECTOR, "#txt2img_tools #paste").click()


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


SECTION = "script_txt2img_openvino"


def section_enabled(driver: Any) -> bool:
    return js(driver, f"return document.querySelector('#{SECTION}_enabled input').checked")


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
