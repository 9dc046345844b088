/*
 * Accelerate with OpenVINO: hover hints for the panel's controls (A1111's `titles`), a confirmation
 * before "Clear cache", a visible "compiling ..." state while a pre-compile runs, and the guard of the
 * panel's refresh after a generation. Element ids and hints come from the Python side, in the hidden
 * `.ov-accelerate-config` block and in the arguments of the bound calls. Runs in gradio 3.41 (A1111)
 * and 4.40 (Forge).
 */
/* global gradioApp, onUiLoaded, onUiUpdate */
var ovAccelerate = (function() {
    "use strict";

    var COMPILING_CLASS = "ov-accelerate-compiling";

    function configs() {
        var blocks = gradioApp().querySelectorAll(".ov-accelerate-config");
        return Array.prototype.map.call(blocks, function(block) {
            return JSON.parse(block.dataset.config);
        });
    }

    function hintTargets(element) {
        // Labels of inputs (span inside <label>), buttons, and the element itself.
        var targets = Array.prototype.slice.call(element.querySelectorAll("label span, span[data-testid='block-info']"));
        if (element.tagName === "BUTTON") {
            targets.push(element);
        }
        return targets;
    }

    function applyHints() {
        if (typeof window.titles !== "object" || window.titles === null) {
            window.titles = {};
        }
        configs().forEach(function(config) {
            Object.keys(config.hints).forEach(function(label) {
                window.titles[label] = config.hints[label];
            });
            Object.keys(config.ids).forEach(function(name) {
                var element = gradioApp().getElementById(config.ids[name]);
                if (!element) {
                    return;
                }
                hintTargets(element).forEach(function(target) {
                    var hint = config.hints[target.textContent.trim()];
                    if (hint) {
                        target.title = hint;
                    }
                });
            });
        });
    }

    function confirmClear(folder, confirmed) {
        var where = folder && folder.trim() ? folder.trim() : "the default cache folder";
        return [folder, window.confirm("Delete every compiled OpenVINO model in " + where + "?\n" +
                                       "The next generation at each size compiles again.")];
    }

    function setCompiling(progressId, on) {
        var element = gradioApp().getElementById(progressId);
        if (element) {
            element.classList.toggle(COMPILING_CLASS, on);
        }
    }

    function startCompile(args, outputCount, progressId) {
        setCompiling(progressId, true);
        var box = gradioApp().querySelector("#" + progressId + " textarea");
        if (box) {
            box.value = "Compiling ...";
        }
        return args.slice(0, args.length - outputCount);
    }

    function refreshCompiling() {
        configs().forEach(function(config) {
            var id = config.ids.precompile_progress;
            var box = gradioApp().querySelector("#" + id + " textarea");
            if (box) {
                setCompiling(id, box.value.indexOf("Compiling") === 0);
            }
        });
    }

    var resultSeen = {};

    function resultText(ids) {
        return ids.map(function(id) {
            // the value's own element: gradio 4 keeps a progress timer beside it in the same block
            var element = gradioApp().getElementById(id);
            var value = element && (element.querySelector(".prose") || element);
            return value ? value.textContent : "";
        }).join("\n");
    }

    /*
     * The refresh of a panel's "Last run" after a generation is bound to the change of the tab's result
     * element. gradio 4 fires that change at every update of the page, not only when a generation changed
     * the element; the refresh's own update would fire it again, without end. This guard, the bound call's
     * JavaScript, lets the call through (resolves with its inputs: none) only when the text of the elements
     * `ids` differs from what the panel `key` saw last; otherwise it never resolves, and gradio (3 and 4)
     * then makes no call. The page opens with the elements empty.
     */
    function whenResultChanged(key, ids) {
        var text = resultText(ids);
        if ((resultSeen[key] || "") === text) {
            return new Promise(function() {});
        }
        resultSeen[key] = text;
        return Promise.resolve([]);
    }

    onUiLoaded(applyHints);
    onUiUpdate(refreshCompiling);

    return {applyHints: applyHints, confirmClear: confirmClear, startCompile: startCompile,
            whenResultChanged: whenResultChanged};
})();
