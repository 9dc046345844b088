"""What the browser tests of the real WebUIs share (A1111's gradio 3.41 page and Forge's gradio 4.40 page):
headless Chromium's options, the extension's element ids, reading a panel's controls, pictures of the page.

The test modules skip when Chromium, chromedriver or selenium is missing (``.ci/browser-setup``), before they
import this module (which imports selenium). The helpers hold for both gradio versions; where the page differs
(the Script dropdown's list items), they try both.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from PIL import Image
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

PANEL = "script_txt2img_accelerate_with_openvino"
"""The element-id prefix of the dropdown entry's panel in txt2img."""
TITLE = "Accelerate with OpenVINO"
SECTION = "script_txt2img_openvino"
"""The element-id prefix of the always-on "OpenVINO" section in txt2img."""
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
CHROMIUM_ARGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--force-device-scale-factor=1", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run")


def chrome_options(webdriver: Any, chromium: str, window: tuple[int, int] = WINDOW) -> Any:
    """Headless Chromium's options for a page of ``window`` size."""
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (*CHROMIUM_ARGS, f"--window-size={window[0]},{window[1]}"):
        options.add_argument(arg)
    return options


def js(driver: Any, script: str, *args: Any) -> Any:
    return driver.execute_script(script, *args)


def set_text(driver: Any, selector: str, text: str) -> None:
    box = driver.find_element(By.CSS_SELECTOR, selector)
    js(driver, "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input', {bubbles: true}))",
       box, text)


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
        # the list's entries: gradio 3.41 names them in data-value, gradio 4 in aria-label
        entry = f'{field} li[data-value="{title}"], {field} li[aria-label="{title}"]'
        options = d.find_elements(By.CSS_SELECTOR, entry)
        if options:
            options[0].click()
        else:  # the list is closed: open it
            d.find_element(By.CSS_SELECTOR, f"{field} input").click()
        return False

    WebDriverWait(driver, 120, poll_frequency=1, ignored_exceptions=(WebDriverException,)).until(pick)


def section_enabled(driver: Any) -> bool:
    return js(driver, f"return document.querySelector('#{SECTION}_enabled input').checked")


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


def assert_readable_picture(image: Image.Image, max_width: int) -> None:
    """A readable picture of a panel, not an empty or clipped one."""
    assert 600 <= image.width <= max_width and image.height >= 500, image.size
    colors = image.getcolors(1 << 16)
    assert colors is None or len(colors) > 50, "the picture is (nearly) a flat colour"
