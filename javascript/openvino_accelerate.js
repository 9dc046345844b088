/*
 * Accelerate with OpenVINO: hover hints for the panel's controls (A1111's `titles`), a confirmation
 * before "Clear cache", and a visible "compiling ..." state while a pre-compile runs.
 * Element ids and hints come from the Python side, in the hidden `.ov-accelerate-config` block.
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

    onUiLoaded(applyHints);
    onUiUpdate(refreshCompiling);

    return {applyHints: applyHints, confirmClear: confirmClear, startCompile: startCompile};
})();
