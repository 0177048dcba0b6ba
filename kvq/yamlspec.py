"""Strict YAML loading that remembers the line of every key, so errors can name field and line.

A spec is plain data: mappings with string keys, lists, and str/int/float/bool/null scalars. Anything
else (explicit tags such as !!binary or !!python/name, merge keys, non-string or duplicate keys) is an
error naming the field, and aliases may not expand the document past MAX_NODES nodes.
"""

from pathlib import Path

import yaml

from kvq.errors import KvqError

YAML_TAG = "tag:yaml.org,2002:"
SCALAR_TAGS = frozenset(YAML_TAG + t for t in ("str", "int", "float", "bool", "null"))
MAX_NODES = 10_000  # a sweep spec holds a few hundred; an alias bomb many orders more


class LocatedMapping(dict):
    """A dict that also knows the 1-based line of each key in its source file."""

    def __init__(self, items, lines: dict[str, int], line: int):
        super().__init__(items)
        self.lines = lines
        self.line = line


def _tag_name(tag: str) -> str:
    return "!!" + tag[len(YAML_TAG):] if tag.startswith(YAML_TAG) else tag


class _Builder:
    """Turns a composed node tree into LocatedMappings, lists and scalars, checking as it goes."""

    def __init__(self, path: Path):
        self.path = path
        self.nodes = 0
        self.constructor = yaml.SafeLoader("")

    def fail(self, node, where: str, message: str):
        field = f"field '{where}': " if where else ""
        raise KvqError(f"{self.path}:{node.start_mark.line + 1}: {field}{message}")

    def build(self, node, where: str = ""):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            self.fail(node, where, f"the document expands to more than {MAX_NODES} nodes (an alias bomb?)")
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, where)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != YAML_TAG + "seq":
                self.fail(node, where, f"YAML tag {_tag_name(node.tag)} is not allowed")
            return [self.build(child, f"{where}[{i}]") for i, child in enumerate(node.value)]
        return self._scalar(node, where)

    def _scalar(self, node, where: str):
        if node.tag not in SCALAR_TAGS:
            self.fail(node, where, f"YAML tag {_tag_name(node.tag)} is not allowed; use plain values")
        try:
            return self.constructor.construct_object(node)
        except (yaml.YAMLError, ValueError) as exc:
            self.fail(node, where, f"cannot read {node.value!r} as {_tag_name(node.tag)}: {exc}")

    def _mapping(self, node, where: str) -> LocatedMapping:
        if node.tag != YAML_TAG + "map":
            self.fail(node, where, f"YAML tag {_tag_name(node.tag)} is not allowed")
        items, lines = {}, {}
        for key_node, value_node in node.value:
            if key_node.tag == YAML_TAG + "merge":
                self.fail(key_node, where, "merge keys ('<<') are not allowed; write the fields out")
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == YAML_TAG + "str"):
                shown = (repr(key_node.value) if isinstance(key_node, yaml.ScalarNode)
                         else "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping")
                self.fail(key_node, where, f"keys must be plain strings, got {shown}")
            key = key_node.value
            line = key_node.start_mark.line + 1
            dotted = f"{where}.{key}" if where else key
            if key in items:
                self.fail(key_node, dotted, f"duplicate key (first on line {lines[key]})")
            items[key] = self.build(value_node, dotted)
            lines[key] = line
        return LocatedMapping(items, lines, node.start_mark.line + 1)


def load_located(path: Path) -> LocatedMapping:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvqError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise KvqError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise KvqError(f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from exc
    except RecursionError as exc:
        raise KvqError(f"{path}: invalid YAML: nested too deeply") from exc
    finally:
        loader.dispose()
    if not isinstance(node, yaml.MappingNode):
        raise KvqError(f"{path}: expected a mapping at the top level")
    try:
        return _Builder(path).build(node)
    except RecursionError as exc:
        raise KvqError(f"{path}: invalid YAML: nested too deeply") from exc


class Fields:
    """Reads typed fields from a located mapping, naming file, line and dotted field on error."""

    def __init__(self, path: Path, mapping: LocatedMapping, prefix: str = ""):
        self.path, self.mapping, self.prefix = path, mapping, prefix

    def fail(self, key: str, message: str):
        line = self.mapping.lines.get(key, self.mapping.line)
        raise KvqError(f"{self.path}:{line}: field '{self.prefix}{key}': {message}")

    def unknown_keys(self, allowed) -> None:
        for key in self.mapping:
            if key not in allowed:
                self.fail(key, f"unknown field; expected one of {', '.join(allowed)}")

    def get(self, key: str, kind: type, default=None, required: bool = False):
        if key not in self.mapping:
            if required:
                line = self.mapping.line
                raise KvqError(f"{self.path}:{line}: field '{self.prefix}{key}' is required")
            return default
        value = self.mapping[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            self.fail(key, f"expected {kind.__name__}, got {value!r}")
        return value

    def get_list(self, key: str, kind: type, default=None, required: bool = False) -> list:
        value = self.mapping.get(key, default)
        if key not in self.mapping and required:
            raise KvqError(f"{self.path}:{self.mapping.line}: field '{self.prefix}{key}' is required")
        if not isinstance(value, list):
            value = [value]
        if not value:
            self.fail(key, "must not be empty")
        for item in value:
            if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
                self.fail(key, f"expected {getattr(kind, '__name__', 'str or null')} items, got {item!r}")
        return value

    def nested(self, key: str) -> "Fields":
        value = self.mapping.get(key, LocatedMapping({}, {}, self.mapping.lines.get(key, self.mapping.line)))
        if not isinstance(value, LocatedMapping):
            self.fail(key, "expected a mapping")
        return Fields(self.path, value, f"{self.prefix}{key}.")
