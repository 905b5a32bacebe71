"""Flags and YAML keys of every stage's config: one builder, one reader, one rule, one error format.

A config is a pydantic model whose leaf fields have dotted paths (`actor.adam.lr`, `data.max_len`,
`max_norm`). A field's spellings are its path, the flat names on the field (`flat(...)`: OpenRLHF's
flat flags) and the names its config's table gives it (where a section class serves several
sections under different flat names: `--actor_num_nodes`, `--critic_num_nodes`). A name may set
several fields: a flat name on a field of a class used twice sets both (`--adam_betas`, the actor's
and the critic's optimiser). Flags, `--config` YAML (nested sections, dotted or flat keys) and a
pipeline's parameters are all read by `to_paths`:

- unknown keys are errors;
- one field given two different values by two of its spellings in one place is an error naming
  both; equal values are fine, and one flag given twice keeps the last (as argparse does);
- precedence: defaults < YAML < flags;
- a validation error names the field by every spelling (`--actor.adam.lr (--actor_learning_rate)`).
"""

from __future__ import annotations

import argparse
import threading
import types
import typing
from collections.abc import Callable
from enum import Enum

from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from rlhf_core.infra.settings import ConfigError


def flat(*names: str, **extra) -> dict:
    """A field's `json_schema_extra` naming its flat spellings, e.g. `Field(2, json_schema_extra=flat("zero_stage"))`;
    `extra` adds other markers (`**NOT_SEMANTIC`)."""
    return {"flat": list(names), **extra}


def parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def flag_kwargs(annotation, description: str | None) -> dict | None:
    """argparse keyword arguments for a field of this type (None: the type has no flag form).

    Booleans take an optional value (`--flag`, `--flag false`), tuples one value per element,
    enums and literals their choices. The default is SUPPRESS: only flags given reach the config.
    """
    ann = annotation
    origin = typing.get_origin(ann)
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        ann, origin = args[0], typing.get_origin(args[0])
    kwargs: dict = {"default": argparse.SUPPRESS, "help": description}
    if ann is bool:
        kwargs.update(nargs="?", const=True, type=parse_bool, metavar="BOOL")
    elif origin is tuple:
        kwargs.update(nargs=len(typing.get_args(ann)), type=typing.get_args(ann)[0])
    elif origin is list:  # one or more values after the flag
        kwargs.update(nargs="+", type=typing.get_args(ann)[0])
    elif origin is typing.Literal:
        kwargs.update(choices=list(typing.get_args(ann)), type=type(typing.get_args(ann)[0]))
    elif isinstance(ann, type) and issubclass(ann, Enum):
        kwargs.update(choices=[m.value for m in ann])
    elif ann in (int, float, str):
        kwargs.update(type=ann)
    elif ann is SecretStr:  # kept out of every dump (`**********`)
        kwargs.update(type=str, metavar="SECRET")
    elif origin is dict:  # given as JSON text; the field's validator reads it
        kwargs.update(type=str, metavar="JSON")
    else:
        return None
    return kwargs


def leaves(model_cls: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Dotted path -> field of every leaf of a (sectioned) config class."""
    out: dict[str, FieldInfo] = {}
    for name, field in model_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(leaves(ann, f"{prefix}{name}."))
        else:
            out[prefix + name] = field
    return out


def format_validation_error(err: ValidationError, source: str, flag_name: Callable[[tuple], str | None]) -> str:
    """One line per pydantic error, each naming its flag (`flag_name(loc)`, None: a check across fields)."""
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        name = flag_name(e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  {name or '(config)'}: unknown field")
        elif e["type"] == "missing":
            lines.append(f"  {name or '(config)'}: required")
        elif name is None:  # a check across fields: its message names them; the input is the whole config
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {name}: {e['msg']} (got {e.get('input')!r})")
    if len(lines) == 2 and "\n" not in lines[1]:  # one problem: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


_UNSET = object()


class Spellings:
    """The spellings of one config class: its leaf paths, the flat names on its fields (`flat`), and
    `aliases` (name -> the paths it sets).

    `transforms`: names whose value is mapped before it is stored (None: the name says nothing),
    e.g. `--bf16` -> `ds.param_dtype bf16`.
    """

    def __init__(self, config_cls: type[BaseModel], aliases: dict[str, tuple[str, ...]],
                 transforms: dict[str, tuple[tuple[str, ...], Callable, str]] | None = None,
                 skip: frozenset[str] = frozenset({"stage"}), deferred: dict[str, str] | None = None):
        self.config_cls, self.skip = config_cls, skip  # skip: fields without a flag
        # OpenRLHF flags of features not built yet: recognised, and refused (exit 2) naming why
        self.deferred = dict(deferred or {})
        self.leaves = leaves(config_cls)
        on_fields: dict[str, tuple[str, ...]] = {}
        for path, field in self.leaves.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            for name in extra.get("flat", ()):
                if name != path:
                    on_fields[name] = (*on_fields.get(name, ()), path)
        twice = set(on_fields) & set(aliases)
        self.aliases, self.transforms = {**on_fields, **aliases}, dict(transforms or {})
        names = [*self.aliases, *self.transforms, *self.deferred]
        clash = set(names) & set(self.leaves)
        unknown = [t for targets in self.aliases.values() for t in targets if t not in self.leaves]
        if clash or unknown or twice or len(set(names)) != len(names):
            raise ValueError(f"{config_cls.__name__}: spellings that are paths {sorted(clash)}, name no field "
                             f"{unknown}, or are both on a field and in the table {sorted(twice)}")
        self._parse = threading.local()  # `_SetFields`: the flag that set each field, per thread and parse
        keys = [*self.leaves, *names]
        self.sections = frozenset(k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1))

    def spellings(self, path: str) -> list[str]:
        """Every flag of a field: its dotted path first, then its other spellings."""
        return [f"--{path}"] + [f"--{name}" for name, targets in self.aliases.items() if path in targets] \
            + [f"--{name}" for name, (targets, _, _) in self.transforms.items() if path in targets]

    def flag_name(self, loc: tuple) -> str | None:
        """An error location's flags, e.g. `--actor.adam.lr (--actor_learning_rate)`; None: a check across fields."""
        path = ".".join(str(p) for p in loc if not isinstance(p, int))
        if not path:
            return None
        names = self.spellings(path)
        return names[0] + (f" ({', '.join(names[1:])})" if len(names) > 1 else "")

    # -- flags ------------------------------------------------------------------------------
    def add_flags(self, parser, config_help: str = "YAML file with any of these fields (nested, dotted or flat)"
                  ) -> None:
        """`--config` and every field's flags: its dotted path and its other spellings. The value lands
        under the dotted path (`vars(args)["actor.adam.lr"]`); `build` takes it."""
        parser.add_argument("--config", default=None, help=config_help)
        for path, field in self.leaves.items():
            kwargs = None if path in self.skip else flag_kwargs(field.annotation, field.description)
            if kwargs is None:
                continue
            others = [f"--{name}" for name, targets in self.aliases.items() if targets == (path,)]
            parser.add_argument(f"--{path}", *others, dest=path, action=_SetFields, spellings=self, **kwargs)
        for name, targets in self.aliases.items():
            if len(targets) > 1:
                kwargs = flag_kwargs(self.leaves[targets[0]].annotation,
                                     "Sets " + " and ".join(f"--{t}" for t in targets))
                kwargs.setdefault("metavar", name.upper())
                parser.add_argument(f"--{name}", dest=targets[0], action=_SetFields, spellings=self, targets=targets,
                                    **kwargs)
        for name, (targets, transform, help_text) in self.transforms.items():
            parser.add_argument(f"--{name}", dest=targets[0], action=_SetFields, spellings=self, targets=targets,
                                transform=transform, default=argparse.SUPPRESS, nargs="?", const=True,
                                type=parse_bool, metavar="BOOL", help=help_text)
        for name, reason in self.deferred.items():
            parser.add_argument(f"--{name}", action=_Deferred, nargs="*", default=argparse.SUPPRESS, reason=reason,
                                help=f"Not built yet: {reason}")

    # -- YAML and parameters ----------------------------------------------------------------
    def _flatten(self, values: dict, prefix: str = "") -> list[tuple[str, object]]:
        out = []
        for key, value in values.items():
            path = f"{prefix}{key}"
            if isinstance(value, BaseModel) and path in self.sections:  # a section already validated
                value = dict(value)
            if isinstance(value, dict) and path in self.sections:
                out.extend(self._flatten(value, f"{path}."))
            else:
                out.append((path, value))
        return out

    def _same_value(self, path: str, a, b) -> bool:
        if a == b:
            return True
        adapter = TypeAdapter(self.leaves[path].annotation)
        try:
            return adapter.validate_python(a) == adapter.validate_python(b)
        except ValidationError:
            return False

    def to_paths(self, values: dict, where: str) -> dict[str, object]:
        """Any mix of nested, dotted and flat keys -> {dotted path: value}; ConfigError for an unknown key
        or for one field given different values by two of its spellings."""
        out: dict[str, tuple[str, object]] = {}
        unknown = []
        for key, value in self._flatten(values):
            if key in self.transforms:
                targets, transform, _ = self.transforms[key]
                value = transform(parse_bool(value))
                if value is None:
                    continue
            elif key in self.leaves:
                targets = (key,)
            elif key in self.aliases:
                targets = self.aliases[key]
            elif key in self.deferred:
                raise ConfigError(deferred_message(key, self.deferred[key]) + f" ({where})")
            else:
                unknown.append(key)
                continue
            for target in targets:
                if target in out and not self._same_value(target, out[target][1], value):
                    first, before = out[target]
                    raise ConfigError(f"invalid configuration ({where}): --{first} ({before!r}) and --{key} "
                                      f"({value!r}) set --{target} to different values: give one")
                out[target] = (key, value)
        if unknown:
            if len(unknown) == 1:
                raise ConfigError(f"invalid configuration ({where}): --{unknown[0]}: unknown field")
            raise ConfigError(f"invalid configuration ({where}):\n" + "\n".join(f"  --{k}: unknown field"
                                                                                 for k in unknown))
        return {path: value for path, (_, value) in out.items()}

    @staticmethod
    def nest(paths: dict[str, object]) -> dict:
        nested: dict = {}
        for path, value in paths.items():
            *sections, name = path.split(".")
            node = nested
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = value
        return nested

    def build(self, yaml_values: dict | None, flag_values: dict, complete: bool = True):
        """Merge YAML (lower precedence) and flags into a validated config, or raise ConfigError.

        `complete=False` allows leaving out the inputs and outputs a pipeline fills in."""
        merged = {**self.to_paths(yaml_values or {}, "--config"), **self.to_paths(flag_values, "flags")}
        try:
            cfg = self.config_cls.model_validate(self.nest(merged))
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, "flags and --config", self.flag_name)) from None
        if complete:
            cfg.check_complete()
        return cfg


def deferred_message(name: str, reason: str) -> str:
    return f"--{name}: not built yet: {reason}"


class _Deferred(argparse.Action):
    """An OpenRLHF flag whose feature is not built yet: recognised (so a script fails on it by name,
    not as an unknown argument) and refused with exit 2."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(None, deferred_message(option_string.lstrip("-"), self.reason))


class _SetFields(argparse.Action):
    """Store a flag's value under each of its target fields; a field given a different value by
    another of its spellings is an argparse error naming both (the same flag again: the last wins)."""

    def __init__(self, option_strings, dest, spellings: Spellings, targets=(), transform=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.spelling_table, self.targets, self.transform = spellings, tuple(targets) or (dest,), transform

    def __call__(self, parser, namespace, values, option_string=None):
        if self.transform is not None:
            values = self.transform(values)
            if values is None:
                return
        table = self.spelling_table
        parse = table._parse
        if getattr(parse, "namespace", None) is not namespace:  # who set each field, for this parse only
            parse.namespace, parse.set_by = namespace, {}
        set_by = parse.set_by
        for target in self.targets:
            before = getattr(namespace, target, _UNSET)
            if before is not _UNSET and before != values and set_by.get(target) != option_string:
                raise argparse.ArgumentError(self, f"{set_by.get(target)} already set --{target} to {before!r}; "
                                             f"give one of its spellings ({', '.join(table.spellings(target))})")
            setattr(namespace, target, values)
            set_by[target] = option_string
