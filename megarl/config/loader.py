"""Build a :class:`MegarlConfig` from YAML files and ``a.b.c=value`` command-line overrides.

Every key is checked against the dataclass tree: unknown keys and values of the wrong type raise
:class:`ConfigError` naming the full dotted key (with a close-match suggestion for typos). Override
values are parsed as YAML scalars/lists (``n=8``, ``lr=1e-6``, ``logger=[console,jsonl]``,
``x=null``). String values may refer to other keys as ``${trainer.project_name}``. Cross-field
consistency is checked by :mod:`megarl.config.validate`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import yaml

from megarl.config.errors import ConfigError
from megarl.config.schema import MegarlConfig


_INTERPOLATION = re.compile(r"\$\{([a-zA-Z0-9_.]+)\}")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _strip_optional(tp) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str) -> Any:
    inner, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {_type_name(inner)})")
    if dataclasses.is_dataclass(inner):
        if isinstance(value, inner):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {inner.__name__} fields, got {type(value).__name__}")
        return _build(inner, value, key)
    origin = typing.get_origin(inner)
    if origin is dict:  # a free mapping (e.g. megatron's own options): its consumer checks the keys
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        _, item_tp = typing.get_args(inner) or (str, Any)
        return {str(k): _coerce(v, item_tp, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(inner) or (Any,)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # `x=a` for a list field means a one-element list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if inner is Any:
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads `1e-6` as a string
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
    if inner is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp}")


def _unknown_key_error(cls, name: str, key: str) -> ConfigError:
    known = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}; valid keys here: {', '.join(known)}")


def unknown_keys(cls, values: dict, prefix: str = "") -> list[str]:
    """Every key of ``values`` (nested mappings walked) that ``cls``'s schema does not have, with what to do
    about it: verl's reason and megarl's way for a verl key (:mod:`megarl.config.verl_keys`), else the closest
    known key."""
    from megarl.config.verl_keys import explain

    types_by_name = _field_types(cls)
    found = []
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in types_by_name:
            explained = [(leaf, explain(leaf)) for leaf in _leaf_keys(value, key)]
            if all(reason is not None for _, reason in explained):
                found += [f"{leaf!r} is a verl key that megarl does not take: {reason}" for leaf, reason in explained]
            else:
                found.append(str(_unknown_key_error(cls, str(name), key)))
            continue
        inner, _ = _strip_optional(types_by_name[name])
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            found += unknown_keys(inner, value, key)
        elif typing.get_origin(inner) is dict and isinstance(value, dict):  # named entries of one section type
            entry_type = (typing.get_args(inner) or (str, Any))[1]
            if dataclasses.is_dataclass(entry_type):
                found += [problem for entry, entry_values in value.items() if isinstance(entry_values, dict)
                          for problem in unknown_keys(entry_type, entry_values, f"{key}.{entry}")]
    return found


def _leaf_keys(value: Any, key: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for name, inner in value.items() for leaf in _leaf_keys(inner, f"{key}.{name}")]
    return [key]


def _check_known(values: dict, where: str = "") -> None:
    problems = unknown_keys(MegarlConfig, values)
    if len(problems) == 1:
        raise ConfigError(f"{problems[0]} ({where.strip()})" if where else problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} config keys refused{where}:\n  - " + "\n  - ".join(problems))


def expand_shorthands(cls, values: dict) -> dict:
    """``values`` with a scalar given for a section whose dataclass names a ``SHORTHAND`` field read as that field
    (``actor.policy_loss=gspo`` is ``actor.policy_loss.loss_mode=gspo``)."""
    types_by_name = _field_types(cls)
    expanded = {}
    for name, value in values.items():
        inner = _strip_optional(types_by_name[name])[0] if name in types_by_name else None
        if inner is not None and dataclasses.is_dataclass(inner):
            if isinstance(value, dict):
                value = expand_shorthands(inner, value)
            elif isinstance(value, str) and getattr(inner, "SHORTHAND", None):
                value = {inner.SHORTHAND: value}
        expanded[name] = value
    return expanded


def _build(cls, values: dict, prefix: str):
    types_by_name = _field_types(cls)
    kwargs = {}
    for name, value in values.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in types_by_name:
            raise _unknown_key_error(cls, str(name), key)
        kwargs[name] = _coerce(value, types_by_name[name], key)
    return cls(**kwargs)


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form a.b.c=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {exc}") from exc
    return key.split("."), value


def _nest(parts: list[str], value: Any) -> dict:
    for part in reversed(parts):
        value = {part: value}
    return value


def load_yaml_mapping(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def flatten_dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a config tree (``to_dict``'s) keyed by its dotted names."""
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten_dotted(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: tree}


def _lookup(tree: dict, dotted: str, origin_key: str):
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{origin_key}: interpolation ${{{dotted}}} refers to an unknown key")
        node = node[part]
    return node


def _resolve_interpolations(tree: dict) -> dict:
    def resolve(node, key, depth=0):
        if depth > 10:
            raise ConfigError(f"{key}: interpolation cycle")
        if isinstance(node, dict):
            return {k: resolve(v, f"{key}.{k}" if key else k, depth) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v, f"{key}[{i}]", depth) for i, v in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            whole = _INTERPOLATION.fullmatch(node)
            if whole:
                return resolve(_lookup(tree, whole.group(1), key), key, depth + 1)
            return _INTERPOLATION.sub(lambda m: str(resolve(_lookup(tree, m.group(1), key), key, depth + 1)), node)
        return node

    return resolve(tree, "")


def derived_experiment_name(tree: dict) -> str:
    """``<adv_estimator>_<model directory name>`` (``grpo_Qwen2.5-7B-Instruct``): a run given no name gets its
    own output folder instead of another run's."""
    model = str(tree["actor_rollout_ref"]["model"]["path"]).rstrip("/")
    model = model.split(":", 1)[1] if model.startswith("embedded:") else Path(model).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{tree['algorithm']['adv_estimator']}_{model}")


def given_keys(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> set[str]:
    """The dotted keys a YAML file and command-line overrides set (not the schema's defaults)."""
    mappings = [load_yaml_mapping(path)] if path is not None else []
    mappings += [_nest(*parse_override(text)) for text in overrides]
    return {leaf for mapping in mappings for name, value in mapping.items() for leaf in _leaf_keys(value, str(name))}


def read_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> MegarlConfig:
    """Defaults <- YAML file (if given) <- overrides, type-checked and interpolated; not yet filled or validated
    (:func:`megarl.run_config.load_config` does both)."""
    tree = to_dict(MegarlConfig())
    if path is not None:
        file_values = expand_shorthands(MegarlConfig, load_yaml_mapping(path))
        _check_known(file_values, f" in {path}")  # every unknown key at once, against the file's own text
        _build(MegarlConfig, file_values, "")  # types, against the file's own text
        tree = _merge(tree, file_values)
    given: dict = {}
    for text in overrides:
        parts, value = parse_override(text)
        given = _merge(given, expand_shorthands(MegarlConfig, _nest(parts, value)))
    _check_known(given, " on the command line")
    tree = _merge(tree, given)
    if tree["trainer"].get("experiment_name") is None:  # before ${trainer.experiment_name} is interpolated
        tree["trainer"]["experiment_name"] = derived_experiment_name(tree)
    return _build(MegarlConfig, _resolve_interpolations(tree), "")


def save_config(cfg: MegarlConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
