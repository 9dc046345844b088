"""The panel and its JavaScript in a real headless Chromium (Debian's chromium + chromedriver, selenium).

The panel is served by gradio 3.41.2 on localhost with the WebUI's page helpers (``gradioApp``,
``onUiLoaded``, ``onUiUpdate``, ``titles``) injected the way A1111 injects its scripts. Installed by
``.ci/browser-setup``; skipped with the reason when chromium, chromedriver or selenium is absent.
Set ``OV_WEBUI_SCREENSHOT=<file>`` to save a screenshot of the fake host's panel (the docs' pictures come
from the real WebUI: ``tests/real_webui/test_real_webui_browser.py``).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
    pytest.skip(
        f"chromium/chromedriver not installed ({CHROMIUM}, {CHROMEDRIVER}): run .ci/browser-setup",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed: run .ci/browser-setup")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

# What A1111's script.js and hints.js give every page (a minimal mirror).
PAGE_HELPERS = """
<script>
function gradioApp() {
    const elems = document.getElementsByTagName('gradio-app');
    const elem = elems.length == 0 ? document : elems[0];
    if (elem !== document) { elem.getElementById = function(id) { return document.getElementById(id); }; }
    return elem.shadowRoot ? elem.shadowRoot : elem;
}
var titles = {};
var uiLoadedCallbacks = [], uiUpdateCallbacks = [], uiLoaded = false;
function onUiLoaded(cb) { uiLoadedCallbacks.push(cb); }
function onUiUpdate(cb) { uiUpdateCallbacks.push(cb); }
document.addEventListener("DOMContentLoaded", function() {
    new MutationObserver(function(m) {
        if (!uiLoaded && gradioApp().querySelector('.ov-accelerate-config')) {
            uiLoaded = true; uiLoadedCallbacks.forEach(function(cb) { cb(); });
        }
        uiUpdateCallbacks.forEach(function(cb) { cb(m); });
    }).observe(gradioApp(), {childList: true, subtree: true});
});
</script>
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_panel(fake_host: Any, extension: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    import gradio.routes

    from ov_accelerate_webui.script import make_script_class

    script_js = (ROOT / "javascript" / "openvino_accelerate.js").read_text()
    css = (ROOT / "style.css").read_text()
    head = f"{PAGE_HELPERS}<script>{script_js}</script><style>{css}</style>"
    original = gradio.routes.templates.TemplateResponse

    def template_response(*args: Any, **kwargs: Any) -> Any:  # as A1111's ui_gradio_extensions does
        if len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], dict) and "request" in args[1]:
            # gradio 3.41 calls TemplateResponse(name, context); the newer starlette in the dev venv
            # (the WebUI ships fastapi 0.94) wants TemplateResponse(request, name, context).
            args = (args[1]["request"], args[0], args[1])
        response = original(*args, **kwargs)
        response.body = response.body.replace(b"</head>", f"{head}</head>".encode())
        response.init_headers()
        return response

    monkeypatch.setattr(gradio.routes.templates, "TemplateResponse", template_response)
    for var in ("no_proxy", "NO_PROXY"):  # gradio checks that it can reach localhost
        monkeypatch.setenv(var, "localhost,127.0.0.1")
    from modules import scripts, ui

    runner = scripts.ScriptRunner(is_img2img=False)  # the txt2img tab, built in A1111's order
    script = runner.add(make_script_class(extension))
    demo = ui.create_tab(runner)
    port = _free_port()
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", script
    finally:
        demo.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1100,1400",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _text(driver: Any, elem_id: str) -> str:
    return driver.execute_script(f"return gradioApp().querySelector('#{elem_id} textarea').value")


def test_panel_hints_devices_and_clear_cache_confirmation(
    served_panel: tuple[str, Any], browser: Any, fake_host: Any, backend_api: Any
) -> None:
    url, script = served_panel
    browser.get(url)
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.ID, script.elem_id("clear_cache")))

    # Hover hints: registered in A1111's `titles` and set on the labels.
    wait.until(lambda d: d.execute_script("return titles['OpenVINO device'] !== undefined"))
    hint = browser.execute_script(
        f"return gradioApp().querySelector('#{script.elem_id('device')} span[data-testid=\"block-info\"]').title"
    )
    assert hint.startswith("Where the accelerated parts run")
    assert browser.find_element(By.ID, script.elem_id("clear_cache")).get_attribute("title").startswith("Delete")

    # The device list shows the device with its full name.
    device = browser.execute_script(f"return gradioApp().querySelector('#{script.elem_id('device')} input').value")
    assert device.startswith("CPU: ")

    # "Clear cache" asks first: declined -> nothing deleted; accepted -> cleared.
    cache_dir = fake_host.tmp_path / "models" / "openvino_cache"
    backend = backend_api.backend_class(
        backend_api.build_settings({"model_caching": True, "cache_dir": str(cache_dir)})
    )
    import torch

    torch.compile(torch.nn.Linear(4, 4), backend=backend)(torch.randn(2, 4))
    assert backend_api.model_cache(str(cache_dir)).total_bytes() > 0
    browser.execute_script(
        "window.confirmCalls = []; window.confirm = function(m) { confirmCalls.push(m); return false; };"
    )
    browser.find_element(By.ID, script.elem_id("clear_cache")).click()
    wait.until(lambda d: _text(d, script.elem_id("cache_size")).startswith("Not cleared"))
    assert browser.execute_script("return confirmCalls.length") == 1
    assert backend_api.model_cache(str(cache_dir)).total_bytes() > 0

    screenshot = os.environ.get("OV_WEBUI_SCREENSHOT")
    if screenshot:
        browser.find_element(By.ID, script.elem_id("panel")).screenshot(str(ROOT / screenshot))

    browser.execute_script("window.confirm = function(m) { confirmCalls.push(m); return true; };")
    browser.find_element(By.ID, script.elem_id("clear_cache")).click()
    wait.until(lambda d: _text(d, script.elem_id("cache_size")).startswith("Cleared."))
    assert backend_api.model_cache(str(cache_dir)).total_bytes() == 0
    time.sleep(0.1)


def test_last_run_updates_after_generate_without_refresh(
    served_panel: tuple[str, Any], browser: Any, extension: Any
) -> None:
    url, script = served_panel
    browser.get(url)
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.ID, "txt2img_generate"))
    assert _text(browser, script.elem_id("status")) == "No generation with OpenVINO yet."
    for part in ("unet", "vae", "text_encoder"):  # a run without compiling: no part selected
        browser.find_element(By.CSS_SELECTOR, f"#{script.elem_id(part)} input").click()
    browser.find_element(By.ID, "txt2img_generate").click()

    wait.until(lambda d: _text(d, script.elem_id("status")).startswith("No part selected"))
    assert "No part selected" in browser.find_element(By.ID, "html_info_txt2img").text
    assert extension.last_status.startswith("No part selected")


def test_pasting_an_infotext_restores_the_script_and_its_panel(served_panel: tuple[str, Any], browser: Any) -> None:
    """A1111's "Read generation parameters" (the tools row's paste button) with an infotext in the prompt."""
    from ov_accelerate_webui.infotext import TITLE
    from ov_accelerate_webui.options import PRECISION_LABELS

    url, script = served_panel
    browser.get(url)
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#txt2img_tools #paste"))

    def paste(infotext: str) -> None:
        prompt = browser.find_element(By.CSS_SELECTOR, "#txt2img_prompt textarea")
        prompt.clear()
        prompt.send_keys(infotext)
        browser.find_element(By.CSS_SELECTOR, "#txt2img_tools #paste").click()
        wait.until(lambda d: _text(d, "txt2img_prompt") == infotext.split("\n")[0])

    def panel() -> dict[str, Any]:
        return browser.execute_script(
            "const q = (s) => gradioApp().querySelector(s);"
            "return {script: q('#script_list input').value, device: q(arguments[0] + ' input').value,"
            " unet: q(arguments[1] + ' input').checked, vae: q(arguments[2] + ' input').checked,"
            " te: q(arguments[3] + ' input').checked, precision: q(arguments[4] + ' input:checked').value};",
            *(f"#{script.elem_id(f)}" for f in ("device", "unet", "vae", "text_encoder", "precision")),
        )

    before = panel()
    assert before["script"] == TITLE and before["device"].startswith("CPU: ")
    assert (before["unet"], before["vae"], before["te"]) == (True, True, True)
    assert before["precision"] == PRECISION_LABELS["auto"]

    paste("a dog\nNegative prompt: cat\nSteps: 20, Sampler: Euler a, Seed: 1, Size: 64x64")
    wait.until(lambda d: panel()["script"] == "None")
    assert panel() == {**before, "script": "None"}

    paste('a cat\nSteps: 1, Seed: 1, Script: Accelerate with OpenVINO, OpenVINO: "CPU, UNet, f32"')
    wait.until(lambda d: panel()["script"] == TITLE)
    after = panel()
    assert (after["unet"], after["vae"], after["te"]) == (True, False, False)
    assert after["precision"] == PRECISION_LABELS["f32"]
    assert after["device"] == before["device"]

    # A device this machine lacks: the panel keeps its device, the rest is pasted, the user is told.
    paste('a bird\nSteps: 1, Seed: 1, Script: Accelerate with OpenVINO, OpenVINO: "GPU.7, UNet+VAE+TE, auto"')
    wait.until(lambda d: panel()["vae"])
    assert panel() == before
    wait.until(lambda d: "'GPU.7' is not available here" in d.execute_script("return document.body.innerText"))
