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

import base64
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from .webui import ROOT, WebUI

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
    pytest.skip("chromium/chromedriver not installed: run .ci/browser-setup", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: run .ci/browser-setup")
from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

PANEL = "script_txt2img_accelerate_with_openvino"
TITLE = "Accelerate with OpenVINO"
SECTION = "script_txt2img_openvino"
WINDOW = (1400, 2000)
PICTURE_WINDOW = (1920, 2600)
"""A desktop-wide window for the pictures: the txt2img tab's left column is then about 940 px wide."""
PICTURE_CACHE_DIR = "/home/user/stable-diffusion-webui/models/openvino_cache"
"""The cache folder the pictures show: where a user's WebUI keeps it by default (the test's own default
is under pytest's temporary folder). Nothing is written there: the field is emptied after the pictures."""
PRECISION_CHOICES = (
    "Automatic (fastest the device supports)",
    "Full precision (f32)",
    "INT8 UNet (calibrated on your first generation; needs NNCF)",
    "8-bit weights (least memory: UNet and text encoder; computes at Automatic)",
)


@pytest.fixture(scope="module")
def page(webui: WebUI) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1",
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


def choose_script(driver: Any, title: str) -> None:
    """Pick ``title`` in the Script dropdown as a user does: open the list, click the entry."""
    field = "#txt2img_script_container #script_list"

    def pick(d: Any) -> bool:
        if script_choice(d) == title:
            return True
        options = d.find_elements(By.CSS_SELECTOR, f'{field} li[data-value="{title}"]')
        if options:
            options[0].click()
        else:  # the list is closed: open it
            d.find_element(By.CSS_SELECTOR, f"{field} input").click()
        return False

    WebDriverWait(driver, 120, poll_frequency=1, ignored_exceptions=(WebDriverException,)).until(pick)


def set_text(driver: Any, selector: str, text: str) -> None:
    box = driver.find_element(By.CSS_SELECTOR, selector)
    js(driver, "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input', {bubbles: true}))",
       box, text)


def controls(driver: Any, prefix: str) -> dict[str, Any]:
    """What a user sees of one panel (``prefix``: the dropdown entry's or the section's element ids): each
    control's label and whether it is shown, the device chosen, the precision choices."""
    return js(driver, """
        const prefix = arguments[0];
        const shown = (e) => !!e && e.offsetParent !== null && e.getBoundingClientRect().width > 0
                             && e.getBoundingClientRect().height > 0;
        const out = {};
        for (const name of ['device', 'unet', 'vae', 'text_encoder', 'precision', 'model_caching', 'cache_dir',
                            'cache_size', 'clear_cache', 'refresh', 'precompile_sizes', 'precompile', 'ready',
                            'status']) {
            const e = document.getElementById(prefix + '_' + name);
            out[name] = {shown: shown(e), text: e ? e.innerText.trim() : null};
        }
        out.device_value = document.querySelector('#' + prefix + '_device input').value;
        out.precision_choices = [...document.querySelectorAll('#' + prefix + '_precision label')]
            .map(l => ({text: l.innerText.trim(), shown: shown(l),
                        value: l.querySelector('input') && l.querySelector('input').value}));
        out.precision = (document.querySelector('#' + prefix + '_precision input:checked') || {}).value;
        return out;""", prefix)


def assert_panel_shown(seen: dict[str, Any]) -> None:
    hidden = [name for name, v in seen.items() if isinstance(v, dict) and not v["shown"]]
    assert not hidden, f"controls not shown: {hidden}; {seen}"
    assert seen["device"]["text"].startswith("OpenVINO device"), seen["device"]
    assert seen["device_value"].startswith("CPU: "), seen["device_value"]  # the device with its full name
    for name, label in (("unet", "Accelerate UNet"), ("vae", "Accelerate VAE"),
                        ("text_encoder", "Accelerate text encoder"), ("model_caching", "Cache compiled models")):
        assert seen[name]["text"].startswith(label), seen[name]
    assert seen["precision"] == PRECISION_CHOICES[0], seen["precision"]  # the default: automatic
    choices = seen["precision_choices"]
    assert [c["value"] for c in choices] == list(PRECISION_CHOICES), choices
    assert all(c["shown"] and c["text"] == c["value"] for c in choices), choices


def picture(driver: Any, selectors: list[str], path: Path, margin: tuple[int, int] = (8, 2)) -> Image.Image:
    """A PNG of the page region of the elements ``selectors`` (their union, ``margin`` px around it
    left and right, top and bottom)."""
    box = js(driver, """
        const rects = arguments[0].map(s => document.querySelector(s).getBoundingClientRect());
        return [Math.min(...rects.map(r => r.left)) + window.scrollX,
                Math.min(...rects.map(r => r.top)) + window.scrollY,
                Math.max(...rects.map(r => r.right)) + window.scrollX,
                Math.max(...rects.map(r => r.bottom)) + window.scrollY];""", selectors)
    left, top = max(0, box[0] - margin[0]), max(0, box[1] - margin[1])
    right, bottom = box[2] + margin[0], box[3] + margin[1]
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": left, "y": top, "width": right - left, "height": bottom - top, "scale": 1}})
    image = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
    image.save(path, optimize=True)
    return image


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

    for image in (panel, section):  # a readable picture, not an empty or clipped one
        assert 600 <= image.width <= PICTURE_WINDOW[0] and image.height >= 500, image.size
        colors = image.getcolors(1 << 16)
        assert colors is None or len(colors) > 50, "the picture is (nearly) a flat colour"
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
