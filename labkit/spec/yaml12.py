"""Spec YAML read by the YAML 1.2 core schema, so that what the user wrote as text stays that text.

PyYAML resolves plain scalars by YAML 1.1, where `2:00:00` is the integer 7200, `0123` is 83 and `yes` is true: a
Slurm time limit would become five days. Here only the YAML 1.2 core schema's forms are numbers, booleans and null
(https://yaml.org/spec/1.2.2/#1032-tag-resolution); everything else is text. A number also keeps the text it was
written as (`SourceInt.text`, `SourceFloat.text`), so a field that wants text takes `0x1F` or `1.50` as written.

Reading is bounded: nesting deeper than MAX_DEPTH, or more than MAX_NODES values once aliases are expanded (a
"billion laughs" bomb), are YAML errors before anything is built from the document; load.py reads at most MAX_BYTES.
"""
from __future__ import annotations

import math
import re

import yaml

MAX_DEPTH = 32
"""Deepest nesting a spec may have; a real one nests four levels (job.container.mounts[0])."""
MAX_NODES = 100_000
"""Most nodes a document may hold, its aliases expanded; a real spec holds a few hundred."""
MAX_BYTES = 256 * 1024
"""Largest spec file read: a real one is a few KB, and PyYAML reads about 200 KB a second."""


class SourceInt(int):
    """An integer that remembers the text it was written as."""
    text: str
    """The scalar as written in the file."""


class SourceFloat(float):
    """A float that remembers the text it was written as."""
    text: str
    """The scalar as written in the file."""


def source_text(value) -> str | None:
    """The text a number was written as in a spec file; None for a value that did not come from one."""
    return getattr(value, "text", None)


def _with_text(cls, number, text: str):
    value = cls(number)
    value.text = text
    return value


_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


def core_number(text: str) -> int | float | None:
    """The number text is by the YAML 1.2 core schema (12, 0o17, 0x1F, 1.5e-4, .inf, .nan), or None."""
    if _INT.fullmatch(text):
        digits = text.lstrip("+")
        try:
            return int(digits[2:], 8) if digits.startswith("0o") else int(digits, 16 if digits[:2] == "0x" else 10)
        except ValueError:  # more than the 4300 digits Python reads
            return None
    if _FLOAT.fullmatch(text):
        lower = text.lower()
        return math.nan if lower == ".nan" else float(lower.replace(".inf", "inf"))
    return None


class SpecLoader(yaml.SafeLoader):
    """A safe loader resolving plain scalars by the YAML 1.2 core schema, with bounded depth and alias expansion."""

    yaml_implicit_resolvers: dict = {}
    yaml_constructors: dict = {}  # only the core schema's tags; !!timestamp, !!binary, !!set and the like are errors

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _check_expanded_size(node)
        return node

    def construct_mapping(self, node, deep=False):
        # YAML 1.2 keys are unique; PyYAML keeps the last silently, which would drop what the user wrote first.
        # Compared as written, so `1` and "1" (which become the same env name) clash too; merged keys may override.
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key_node.value[:200]!r} is given "
                                                            "twice; keep one", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        number = core_number(text)
        if not isinstance(number, int):  # an explicit !!int on text, or too many digits: the field refuses the text
            return text
        return _with_text(SourceInt, number, text)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        number = core_number(text)
        if number is None:  # an explicit !!float on text: the field refuses the text
            return text
        return _with_text(SourceFloat, float(number), text)

    def construct_yaml_bool(self, node):
        text = self.construct_scalar(node)
        if text.lower() not in ("true", "false"):  # an explicit !!bool on text: the field refuses it
            return text
        return text.lower() == "true"


def _check_expanded_size(root) -> None:
    """Refuse a document whose aliases nest it deeper than MAX_DEPTH, expand it to more than MAX_NODES nodes, or make
    a node contain itself. Aliases share nodes, so each node is measured once: (expanded size, height)."""
    measured: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()

    def refuse(node, problem: str):
        raise yaml.composer.ComposerError(None, None, problem, node.start_mark)

    def measure(node, depth: int) -> tuple[int, int]:
        key = id(node)
        if key in open_nodes:
            refuse(node, "an alias refers to a node that contains it")
        if key not in measured:
            if depth > MAX_DEPTH:
                refuse(node, f"aliases nest the spec deeper than {MAX_DEPTH} levels")
            open_nodes.add(key)
            children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
                node.value if isinstance(node, yaml.SequenceNode) else []
            parts = [measure(child, depth + 1) for child in children]
            open_nodes.discard(key)
            measured[key] = (1 + sum(s for s, _ in parts), 1 + max((h for _, h in parts), default=0))
        total, height = measured[key]
        if total > MAX_NODES:
            refuse(node, f"holds more than {MAX_NODES} values, its aliases expanded; a spec holds a few hundred")
        if depth + height > MAX_DEPTH + 1:
            refuse(node, f"aliases nest the spec deeper than {MAX_DEPTH} levels")
        return measured[key]

    if root is not None:
        measure(root, 1)


SpecLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                 ["~", "n", "N", ""])
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789"))
# Merge keys are not YAML 1.2, but specs written for PyYAML use them to share blocks; the size check bounds them.
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
for tag, construct in (("null", SpecLoader.construct_yaml_null), ("bool", SpecLoader.construct_yaml_bool),
                       ("str", SpecLoader.construct_yaml_str), ("seq", SpecLoader.construct_yaml_seq),
                       ("map", SpecLoader.construct_yaml_map)):
    SpecLoader.add_constructor(f"tag:yaml.org,2002:{tag}", construct)
SpecLoader.add_constructor(None, SpecLoader.construct_undefined)
SpecLoader.add_constructor("tag:yaml.org,2002:int", SpecLoader.construct_yaml_int)
SpecLoader.add_constructor("tag:yaml.org,2002:float", SpecLoader.construct_yaml_float)
SpecLoader.add_constructor("tag:yaml.org,2002:merge", SpecLoader.construct_yaml_str)  # `<<` anywhere but a key


def load(text: str):
    """The plain data of one YAML document, read by the YAML 1.2 core schema; raises yaml.YAMLError."""
    return yaml.load(text, Loader=SpecLoader)
