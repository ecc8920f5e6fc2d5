"""The ``dualseg`` command line.

Each command lives beside the code it drives and exposes ``main(argv: list[str]) -> int``;
this file only names them, so ``dualseg --help`` stays fast (nothing heavy is imported until a
command runs) and the call graph stays visible: command name -> module -> ``main``.
"""

from __future__ import annotations

import importlib
import sys

from dualseg.errors import DualsegError  # light: no torch import

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("dualseg.commands.demo", "train, evaluate and refine on a built-in synthetic dataset"),
    "train": ("dualseg.commands.train", "train a model from a YAML config (+ overrides)"),
    "eval": ("dualseg.commands.eval", "evaluate a checkpoint: mIoU, boundary F1, trimap mIoU"),
    "predict": ("dualseg.commands.predict", "segment images: label PNG, colour PNG, overlay"),
    "augment": ("dualseg.commands.augment", "write N augmented image/label pairs plus a list file"),
    "data": ("dualseg.commands.data", "dataset tools: 'dualseg data check ROOT'"),
    "refine": ("dualseg.commands.refine", "method B: 'refine fit' and 'refine apply'"),
    "export": ("dualseg.commands.export", "export a checkpoint to ONNX or TorchScript"),
    "serve": ("dualseg.commands.serve", "local web page and JSON API for segmentation"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = [
        "usage: dualseg COMMAND [options]   (dualseg COMMAND --help for a command's options)",
        "",
        "dualseg: dual-branch semantic segmentation and boundary re-optimization.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if argv[0] == "--version":
        from dualseg._version import __version__

        print(f"dualseg {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dualseg: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print("dualseg: interrupted", file=sys.stderr)
        return 130
    except DualsegError as err:  # expected, user-facing failures: one clear line, no traceback
        print(f"dualseg {name}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
