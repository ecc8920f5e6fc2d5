"""YAML files and ``--section.field`` flags into a checked :class:`Config` (sections:
:mod:`dualseg.engine.options`); every mistake is one line naming the key and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import (
    ActionConfigFile,
    ActionYesNo,
    ArgumentParser,
    DefaultHelpFormatter,
    _loaders_dumpers,
    set_loader,
)

from dualseg.console import ExamplesHelpFormatter, examples
from dualseg.engine.options import SECTIONS, Config, config_to_dict, field_docs
from dualseg.errors import ConfigError
from dualseg.io import atomic_write_text

TRAIN_EXAMPLES = (
    "dualseg train --data.root DIR --train.max_iters 2000",
    "dualseg train --config configs/camvid_mobilenet_v2.yaml --optim.lr 0.01 --train.max_iters 100",
    "dualseg train --config configs/camvid_mobilenet_v2.yaml --resume auto",
)


# --------------------------------------------------------------------------- YAML
# YAML 1.1's base-60 numbers: digits joined by colons (255:1 would be 15301, 1:30 be 90)
_BASE_60 = r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"
_FLOAT = r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$"""


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The one YAML reader of configs and flag values: ``1e4`` a float, a date text, no base-60
    numbers, a key written twice refused."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            if key in seen:
                where = (
                    f"on line {line}" if seen[key] == line else f"(lines {seen[key]} and {line})"
                )
                raise yaml.MarkedYAMLError(
                    problem=f"key {key!r} is written twice {where}",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, re.compile(f"(?!{_BASE_60}$){rx.pattern}", rx.flags) if tag.endswith(":int") else rx)
        for tag, rx in resolvers
        if not tag.endswith((":timestamp", ":float"))
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(_FLOAT, re.X), list("-+0123456789.")
)


def _yaml_load(stream: str) -> Any:
    """jsonargparse's loader; ``--data.root a:`` (a bare key) stays text."""
    value = yaml.load(stream, Loader=_Loader)
    if isinstance(value, dict) and len(value) == 1 and stream.strip() == f"{next(iter(value))}:":
        return stream
    return value


def _read_yaml(path: str, *, inline: bool = False, section: str | None = None) -> dict[str, Any]:
    """A config file's mapping, or one :class:`ConfigError` naming the file and the fix."""
    where = "the --config text" if inline else path
    try:
        d = yaml.load(path if inline else Path(path).read_text(encoding="utf-8"), Loader=_Loader)
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a YAML text file; pass a config file (.yaml)") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where} is not valid YAML{at}: {problem}; fix the file") from None
    what = f"{section}'s fields" if section else "sections (data, model, optim, train)"
    if not d:
        raise ConfigError(f"{where} is empty: give at least one of {what}")
    if not isinstance(d, dict):
        raise ConfigError(f"{where} is not a dualseg config: it must map {what} to their values")
    if section is None and (bad := [k for k in SECTIONS if not isinstance(d.get(k), dict | None)]):
        raise ConfigError(f"{where}: config section {bad[0]!r} must be a mapping of keys")
    if section is None and (unknown := [str(k) for k in d if k not in SECTIONS]):
        if not inline:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
            row = next((i for i, s in enumerate(lines, 1) if s.startswith(f"{unknown[0]}:")), 0)
            where += f" (line {row})" if row else ""
        raise ConfigError(
            f"{where}: unknown config section {unknown[0]}{_near(unknown[0], SECTIONS)}"
        )
    return {section: d} if section else d


# --------------------------------------------------------------------------- parsing
def build_parser(prog: str = "dualseg train") -> Any:
    """``--config FILE``, one flag per config field, then the command's own flags."""

    class Formatter(ExamplesHelpFormatter, DefaultHelpFormatter):
        pass

    set_loader("dualseg_yaml", _yaml_load, (yaml.YAMLError,))
    # jsonargparse reads typed values ("1:30") with its own YAML loader (no public setter)
    _loaders_dumpers.yaml_default_loader = _Loader
    parser = ArgumentParser(
        prog=prog,
        description="Train a segmentation model (spec S3). Values come from --config YAML "
        "files, then from flags (--section.field value), later ones winning. Each section is "
        "a block of the YAML file (docs/training.md).",
        epilog=examples(*TRAIN_EXAMPLES),
        formatter_class=Formatter,
        exit_on_error=False,
        allow_abbrev=False,  # --conf would slip past the --config checks
        parser_mode="dualseg_yaml",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(Config, None)
    parser.add_argument(
        "--resume",
        type=str | None,
        default=None,
        help="checkpoint to resume from, or 'auto' for <train.out_dir>/last.pt when present",
    )
    parser.add_argument(
        "--overwrite",
        action=ActionYesNo,
        default=False,
        help="replace the run already in train.out_dir (without it, such a run is refused)",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="same as --train.quiet true")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    docs = {f"{s}.{k}": v for s, cls in SECTIONS.items() for k, v in field_docs(cls).items()}
    for action in parser._actions:  # jsonargparse reads no field metadata
        action.help = docs.get(action.dest, action.help)
    for key, cls in SECTIONS.items():
        if (group := parser.groups.get(key)) is not None:
            group.title = f"{key} ({cls.__doc__})"
    return parser


def parse_command(argv: list[str] | None) -> tuple[Config, str | None, dict[str, bool]]:
    """``dualseg train``'s arguments: a checked :class:`Config`, ``--resume`` and the flags
    ``{"overwrite", "json"}``; a bad flag or key is one :class:`ConfigError`."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    files = _config_files(argv)
    try:
        ns = parser.parse_args(argv)
    except Exception as err:  # jsonargparse's ArgumentError (or a YAML / type error)
        raise ConfigError(_explain(str(err), parser)) from None
    cfg = _instantiate(parser, ns)
    given, roots = {a.partition("=")[0] for a in argv}, cfg.data.root or ()
    if (
        cfg.data.preset is not None
        and "--data.root" in given
        and "--data.preset" not in given
        and any("preset" in (d.get("data") or {}) for _, d in files)
        and all(
            Path(r, "meta.json").is_file() for r in ([roots] if isinstance(roots, str) else roots)
        )
    ):  # the file's preset was for its dataset: the folder's meta.json describes this one
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, preset=None))
    return cfg, ns.resume, {"overwrite": bool(ns.overwrite), "json": bool(ns.json)}


def _config_files(argv: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each ``--config`` (or ``--SECTION FILE``) read first, so a bad file is one line naming
    it; a flag that a later file sets again is refused (the file would win)."""
    found = []
    for j, arg in enumerate(argv):
        name, eq, attached = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in ("config", *SECTIONS) or not (eq or j + 1 < len(argv)):
            continue
        value = attached if eq else argv[j + 1]
        inline = "\n" in value or value.lstrip().startswith("{")
        data = _read_yaml(value, inline=inline, section=None if name == "config" else name)
        for flag in argv[:j]:
            key = flag[2:].partition("=")[0] if flag.startswith("--") else ""
            section, _, leaf = key.partition(".")
            if leaf and leaf in (data.get(section) or {}):
                raise ConfigError(
                    f"--{key} comes before --{name} {value}, which sets {key} again and would "
                    f"win; put --{name} first, then the flags that change it"
                )
        found.append((value, data))
    return found


def _instantiate(parser: Any, ns: Any) -> Config:
    cfg = parser.instantiate(ns)
    train = dataclasses.replace(cfg.train, quiet=True) if getattr(ns, "quiet", False) else cfg.train
    return Config(data=cfg.data, model=cfg.model, optim=cfg.optim, train=train)


def _explain(message: str, parser: Any) -> str:
    """One line for a jsonargparse error, with the closest valid key for an unknown one."""
    message = " ".join(message.split())
    unknown = re.search(r"unrecognized arguments: (--[\w.\-]+)", message)
    group = re.search(r"Group '(\w+)' does not accept option '([\w\-]+)'", message)
    if not (unknown or group):
        return _type_error(message) or f"invalid arguments: {message}; see dualseg train --help"
    keys = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    if unknown:
        return f"unknown flag {unknown.group(1)}{_near(unknown.group(1), keys)}"
    key = f"{group.group(1)}.{group.group(2)}"  # a YAML key: named as YAML writes it
    return f"unknown config key {key}{_near(key, [k[2:] for k in keys])}"


def _near(key: str, choices: Any) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else "; see dualseg train --help"


_KINDS = {int: "an integer", float: "a number", str: "text", bool: "true | false",
          type(None): "null"}  # fmt: skip


def _takes(kind: Any) -> str:
    """A field's type in words: ``int | None`` -> ``an integer or null``."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Literal:
        return " | ".join(str(a) for a in args)
    if typing.get_origin(kind) is tuple:
        n = len(args)
        return (
            "a list, e.g. [1, 2]" if ... in args else f"a list of {n}, e.g. {list(range(1, n + 1))}"
        )
    if args:  # a union
        return " or ".join(_takes(a) for a in args)
    return _KINDS.get(kind, str(kind))


def _type_error(message: str) -> str | None:
    """jsonargparse's type error as one line: the key, the value, what it takes."""
    found = re.search(r'Parser key "(\w+)\.(\w+)":', message)
    given = re.findall(r"Given value: (.*)", message) or re.findall(r"Got value: (.*)", message)
    if found is None or not given:
        return None
    section, name, value = found.group(1), found.group(2), given[-1].strip()
    key = f"{section}.{name}"
    if value == "None":
        return (
            f"{key} has no value (null, or a YAML key left blank): give one, or leave the key out"
        )
    kind = typing.get_type_hints(SECTIONS[section])[name]
    return f"{key}: {value!r} is not valid; it takes {_takes(kind)} (see dualseg train --help)"


# --------------------------------------------------------------------------- files, values
def load_config(path: str | Path, **overrides: dict[str, Any]) -> Config:
    """Read a YAML config; ``overrides`` are per-section dicts, e.g. ``train={"max_iters": 5}``."""
    d, parser = _read_yaml(str(path)), build_parser()
    for section, values in overrides.items():
        d.setdefault(section, {}).update(values)
    try:
        ns = parser.parse_object(d)
    except Exception as err:  # jsonargparse's ArgumentError: name the bad key, no traceback
        raise ConfigError(_explain(str(err), parser)) from None
    return _instantiate(parser, ns)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomic); ``--config`` reads it back."""
    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
