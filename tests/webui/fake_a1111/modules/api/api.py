"""Fake ``modules.api.api``: the routes of A1111 v1.10.1's HTTP API that scripts are used through.

``POST /sdapi/v1/txt2img`` / ``img2img`` with ``script_name`` (matched case-insensitively against the
dropdown scripts' titles) and ``script_args`` (positional, in ``ui()`` order) run the script as
``Api.text2imgapi`` does: one list of every script's args (the UI components' values, always-on
scripts' included) with the request's ``script_args`` put in the chosen script's slice and
``alwayson_scripts`` args in theirs (``init_script_args``), the queue lock held,
``shared.state.begin``/``end`` around ``scripts_txt2img.run(p, *script_args)``. The reply's ``info`` is
``Processed.js()``.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from fastapi import FastAPI, HTTPException
from PIL import Image

from modules import call_queue, processing, scripts, shared


def encode_pil_to_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def decode_base64_to_image(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text.split(",", 1)[-1])))


class Api:
    """Registers the routes on ``app`` (A1111 does it when started with ``--api``)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        app.add_api_route("/sdapi/v1/txt2img", self.text2imgapi, methods=["POST"])
        app.add_api_route("/sdapi/v1/img2img", self.img2imgapi, methods=["POST"])
        app.add_api_route("/sdapi/v1/scripts", self.get_scripts_list, methods=["GET"])
        app.add_api_route("/sdapi/v1/script-info", self.get_script_info, methods=["GET"])
        app.add_api_route("/sdapi/v1/interrupt", self.interruptapi, methods=["POST"])
        app.add_api_route("/sdapi/v1/progress", self.progressapi, methods=["GET"])

    @staticmethod
    def _selectable(name: str | None, runner: scripts.ScriptRunner) -> tuple[Any, int | None]:
        if not name:
            return None, None
        try:
            index = runner.title_index(name)
        except ValueError:
            raise HTTPException(status_code=422, detail=f"Script '{name}' not found") from None
        return runner.selectable_scripts[index], index

    @staticmethod
    def init_default_script_args(runner: scripts.ScriptRunner) -> list:
        """One list for every script's args (up to the largest ``args_to``), each script's slice holding
        its components' values and ``[0]`` (the dropdown) 0, as A1111 builds it once the UI exists."""
        script_args: list = [None] * max([1, *(s.args_to for s in runner.scripts)])
        script_args[0] = 0
        for script in runner.scripts:
            if script.controls:
                script_args[script.args_from : script.args_to] = [getattr(c, "value", None) for c in script.controls]
        return script_args

    def init_script_args(self, request: dict, runner: scripts.ScriptRunner, script: Any, index: int | None) -> list:
        """The request's ``script_args`` replace the chosen script's slice (a list of another length moves
        the arguments of the scripts after it, as in A1111); ``alwayson_scripts`` {title: {"args": [...]}}
        set the start of an always-on script's slice."""
        script_args = self.init_default_script_args(runner)
        if script is not None:
            script_args[script.args_from : script.args_to] = request.get("script_args", [])
            script_args[0] = index + 1
        for name, entry in (request.get("alwayson_scripts") or {}).items():
            alwayson = next((s for s in runner.scripts if s.title().lower() == name.lower()), None)
            if alwayson is None:
                raise HTTPException(status_code=422, detail=f"always on script {name} not found")
            if not alwayson.alwayson:
                detail = "Cannot have a selectable script in the always on scripts params"
                raise HTTPException(status_code=422, detail=detail)
            args = entry.get("args", [])
            for i in range(min(alwayson.args_to - alwayson.args_from, len(args))):
                script_args[alwayson.args_from + i] = args[i]
        return script_args

    def _run(self, request: dict, runner: scripts.ScriptRunner, p: Any) -> dict:
        script, index = self._selectable(request.get("script_name"), runner)
        script_args = self.init_script_args(request, runner, script, index)
        with call_queue.queue_lock:
            p.is_api, p.scripts = True, runner
            try:
                shared.state.begin(job="scripts_txt2img")
                if script is not None:
                    p.script_args = script_args
                    processed = runner.run(p, *p.script_args)
                else:
                    p.script_args = tuple(script_args)
                    processed = processing.process_images(p)
            finally:
                shared.state.end()
        images = [encode_pil_to_base64(image) for image in processed.images]
        return {"images": images, "parameters": request, "info": processed.js()}

    @staticmethod
    def _fields(request: dict) -> dict:
        skip = {"script_name", "script_args", "send_images", "save_images", "alwayson_scripts", "init_images"}
        return {k: v for k, v in request.items() if k not in skip}

    def text2imgapi(self, request: dict) -> dict:
        p = processing.StableDiffusionProcessingTxt2Img(sd_model=shared.sd_model, **self._fields(request))
        return self._run(request, scripts.scripts_txt2img, p)

    def img2imgapi(self, request: dict) -> dict:
        images = [decode_base64_to_image(x) for x in request.get("init_images", [])]
        p = processing.StableDiffusionProcessingImg2Img(
            sd_model=shared.sd_model, init_images=images, **self._fields(request)
        )
        return self._run(request, scripts.scripts_img2img, p)

    def get_scripts_list(self) -> dict:
        """The lower-cased titles of all scripts that have controls (always-on ones too)."""
        return {
            "txt2img": [s.name for s in scripts.scripts_txt2img.scripts if s.name is not None],
            "img2img": [s.name for s in scripts.scripts_img2img.scripts if s.name is not None],
        }

    def get_script_info(self) -> list[dict]:
        res = []
        for runner in (scripts.scripts_txt2img, scripts.scripts_img2img):
            for script in runner.scripts:
                if script.name is None:
                    continue
                args = [
                    {
                        "label": getattr(c, "label", None),
                        "value": getattr(c, "value", None),
                        "choices": getattr(c, "choices", None),
                    }
                    for c in script.controls
                ]
                res.append(
                    {"name": script.name, "is_img2img": runner.is_img2img, "is_alwayson": script.alwayson, "args": args}
                )
        return json.loads(json.dumps(res, default=str))

    def interruptapi(self) -> dict:
        shared.state.interrupt()
        return {}

    def progressapi(self) -> dict:
        state = shared.state
        return {
            "state": {
                "job_count": state.job_count,
                "job_no": state.job_no,
                "sampling_step": state.sampling_step,
                "sampling_steps": state.sampling_steps,
                "interrupted": state.interrupted,
            },
            "textinfo": state.textinfo,
        }
