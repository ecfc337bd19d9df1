"""How a settings field says everything about its key, once: `field(metadata=...)` built here.

Each field of the model (`gateway.settings.model`) carries a `Spec`: the parser of its YAML value
(which also gives the JSON Schema type), a one-line description, and the YAML key when it is not
the field's name. Nested sections and lists of sections say which settings class they hold.
The loader (`gateway.settings.load`) and the schema (`gateway.settings.schema`) walk these specs
generically, and `Checked.__post_init__` runs the same parsers on objects built in code, so a
key is declared in exactly one place and every way in obeys the same checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.settings.parse import Invalid, Parser

#: the metadata key under which a field keeps its `Spec`
FIELD_KEY = "hedge_gateway.field"
#: turns a key relative to one settings object into the path shown in a message
At = Callable[[str], str]


class ConfigError(ValueError):
    """The configuration is unusable. `errors` holds one message per problem, each starting
    with the key path it concerns; `str()` joins them one per line."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors: tuple[str, ...] = (errors,) if isinstance(errors, str) else tuple(errors)
        super().__init__("\n".join(self.errors))


@dataclass(frozen=True, slots=True)
class Spec:
    """What the model says about one key. Exactly one of `parse`, `section`, `items` is set."""

    #: one line for `hedge-gateway schema` (and so for editors)
    doc: str
    #: a scalar: its parser, which also carries the JSON Schema of its YAML values
    parse: Parser[Any] | None = None
    #: the YAML key when it is not the field's name; `group.key` puts it inside mapping `group`
    key: str | None = None
    #: a nested mapping read into this settings class
    section: type[Checked] | None = None
    #: a required, non-empty list of mappings read into this settings class (a tuple in the model)
    items: type[Checked] | None = None
    #: what one entry of `items` is called in messages ("pool", "backend")
    item_name: str = ""
    #: `items` may be absent or empty (top-level `keys:`); else at least one is required
    empty_ok: bool = False
    #: False where the default stands for "see the description" rather than a value a file
    #: would write (a backend's model is its pool's name; its base_url is required for openai)
    default_shown: bool = True


def scalar(parse: Parser[Any], doc: str, *, key: str | None = None,
           default_shown: bool = True) -> Mapping[str, Spec]:
    """The metadata of a scalar field: `field(default=..., metadata=scalar(parser, "doc"))`."""
    return {FIELD_KEY: Spec(doc, parse=parse, key=key, default_shown=default_shown)}


def section(cls: type[Checked], doc: str) -> Mapping[str, Spec]:
    """The metadata of a field that holds a nested settings object."""
    return {FIELD_KEY: Spec(doc, section=cls)}


def items(cls: type[Checked], item_name: str, doc: str, *,
          empty_ok: bool = False) -> Mapping[str, Spec]:
    """The metadata of a field that holds a tuple of settings objects: at least one, unless
    `empty_ok` (then the field's default is the empty tuple)."""
    return {FIELD_KEY: Spec(doc, items=cls, item_name=item_name, empty_ok=empty_ok)}


def specs(cls: type[Any]) -> list[tuple[dataclasses.Field[Any], Spec]]:
    """Every field of a settings class with its spec, in the order a file writes them: the
    fields' order, except that lists of entries (`pools`, `backends`) come last, after the
    short keys. Messages ("expected one of ...", errors in file order) and the schema follow it."""
    pairs = [(f, f.metadata[FIELD_KEY]) for f in dataclasses.fields(cls)]
    return sorted(pairs, key=lambda pair: pair[1].items is not None)


def yaml_key(f: dataclasses.Field[Any], spec: Spec) -> tuple[str | None, str]:
    """(the mapping the key sits in, or None for the object's own mapping; the key)."""
    group, _, key = (spec.key or f.name).rpartition(".")
    return group or None, key


def yaml_layout(cls: type[Any]) -> dict[str | None, list[str]]:
    """The keys of a settings class as the YAML file spells them: `None` maps to the keys of
    its own mapping (groups included, in `specs` order), each group to the keys inside it."""
    layout: dict[str | None, list[str]] = {None: []}
    for f, spec in specs(cls):
        group, key = yaml_key(f, spec)
        if group is not None and group not in layout:
            layout[None].append(group)
            layout[group] = []
        layout[group].append(key)
    return layout


def has_default(f: dataclasses.Field[Any]) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


class Checked:
    """Base of every settings class: construction checks each field with its parser (storing
    the parsed value, so `weight=1` and `weight: 1` give the same object), fills defaults that
    depend on other fields (`_complete`), then applies the rules that span fields (`_rules`).
    A settings object built in code is therefore as valid as one loaded from a file, and an
    invalid one raises `ConfigError` with the same messages, keys relative to the object."""

    __slots__ = ()
    #: descriptions of the YAML groups of dotted keys (`hedging` of `hedging.enabled`)
    groups: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        problems = list(_field_problems(self))
        if not problems:
            self._complete()
            problems = list(self._rules(str))
        if problems:
            raise ConfigError(problems)

    def _complete(self) -> None:
        """Fill defaults that depend on other fields; override where there are such."""

    def _rules(self, at: At) -> Iterator[str]:
        """Problems that span fields, one message each, its key path made by `at`."""
        return iter(())

    def _set(self, name: str, value: object) -> None:
        """Store a normalised value during construction (the classes are frozen)."""
        object.__setattr__(self, name, value)


def _field_problems(obj: Checked) -> Iterator[str]:
    """Run every field's parser on its value (defaults are trusted), normalising in place."""
    for f, spec in specs(type(obj)):
        current = getattr(obj, f.name)
        if type(current) is type(f.default) and current == f.default:
            continue
        if spec.parse is not None:
            try:
                obj._set(f.name, spec.parse(current))
            except Invalid as problem:
                yield f"{f.name}: {problem}"
        elif spec.section is not None:
            if not isinstance(current, spec.section):
                yield f"{f.name}: must be a {spec.section.__name__}"
        elif spec.items is not None:
            entries = tuple(current) if isinstance(current, list | tuple) else None
            if entries is None or (not entries and not spec.empty_ok):
                yield f"{f.name}: must list at least one {spec.item_name}"
            elif not all(isinstance(entry, spec.items) for entry in entries):
                yield f"{f.name}: every entry must be a {spec.items.__name__}"
            else:
                obj._set(f.name, entries)


def unchecked(cls: type[Any], values: Mapping[str, Any]) -> Any:
    """An instance without the checks of construction. The loader builds these for parts that
    already have errors, so that the rules of their parents still run on what did parse and
    one pass reports every problem; such an instance never leaves the loader."""
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        object.__setattr__(obj, f.name, values.get(f.name))
    return obj
