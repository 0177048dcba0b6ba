"""YAML loading that remembers the line of every key, so errors can name field and line."""

from pathlib import Path

import yaml

from kvq.errors import KvqError


class LocatedMapping(dict):
    """A dict that also knows the 1-based line of each key in its source file."""

    def __init__(self, items, lines: dict[str, int], line: int):
        super().__init__(items)
        self.lines = lines
        self.line = line


def _construct(node, loader):
    if isinstance(node, yaml.MappingNode):
        items, lines = {}, {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            items[key] = _construct(value_node, loader)
            lines[key] = key_node.start_mark.line + 1
        return LocatedMapping(items, lines, node.start_mark.line + 1)
    if isinstance(node, yaml.SequenceNode):
        return [_construct(child, loader) for child in node.value]
    return loader.construct_object(node, deep=True)


def load_located(path: Path) -> LocatedMapping:
    try:
        text = path.read_text()
    except OSError as exc:
        raise KvqError(f"cannot read {path}: {exc.strerror}") from exc
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise KvqError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
    finally:
        loader.dispose()
    if not isinstance(node, yaml.MappingNode):
        raise KvqError(f"{path}: expected a mapping at the top level")
    return _construct(node, yaml.SafeLoader(""))
