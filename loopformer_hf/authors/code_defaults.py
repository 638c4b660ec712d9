"""The defaults of the configuration class an authors' config.json names in `auto_map`: the repo's own Python code,
read as text and parsed with `ast`, never imported or executed (their module may run anything on import)."""

import ast

from .files import resolve_file

_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _constant(node):
    """The value of a constant expression in parsed source (literals, lists, + - * / of them), or raise ValueError:
    defaults such as `steps=[1/8]*8` are read without executing anything."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_constant(item) for item in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _constant(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) and right <= 4096:
            return left * right  # `[1/8]*8`; a list too long for a trajectory is not read
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _OPERATORS[type(node.op)](left, right)
    raise ValueError("not a constant")


def _stated_pairs(statement):
    """(name, value node) pairs a class-body statement states: an assignment, or `__init__`'s keyword defaults."""
    if isinstance(statement, ast.Assign):
        return [(t.id, statement.value) for t in statement.targets if isinstance(t, ast.Name)]
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
        return [(statement.target.id, statement.value)]
    if isinstance(statement, ast.FunctionDef) and statement.name == "__init__":
        args = statement.args
        positional = args.posonlyargs + args.args
        pairs = list(zip([a.arg for a in positional[len(positional) - len(args.defaults) :]], args.defaults))
        return pairs + [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return []


def source_defaults(text, class_name):
    """{name: default} of the configuration class `class_name` in Python source `text`: its `__init__` keyword
    defaults and class-level assignments, its bases in the same file first. Parsed with `ast`, never executed."""
    classes = {node.name: node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ClassDef)}

    def defaults_of(name, seen):
        node = classes.get(name)
        if node is None or name in seen:
            return {}
        found = {}
        for base in node.bases:
            if isinstance(base, ast.Name):
                found.update(defaults_of(base.id, seen | {name}))
        for statement in node.body:
            for key, value in _stated_pairs(statement):
                try:
                    found[key] = _constant(value)
                except ValueError:
                    found.pop(key, None)  # a default computed at run time states nothing we can read
        return found

    return defaults_of(class_name, frozenset())


def read_code_defaults(path, config_dict, hub_kwargs):
    """(defaults, source name) of the configuration class `auto_map` names in the repo's own code, or (None, None)."""
    reference = (config_dict.get("auto_map") or {}).get("AutoConfig")
    if not isinstance(reference, str) or "--" in reference or "." not in reference:
        return None, None  # no code, or code in another repo
    module, class_name = reference.rsplit(".", 1)
    filename = module.replace(".", "/") + ".py"
    resolved = resolve_file(path, filename, hub_kwargs)
    if resolved is None:
        return None, None
    with open(resolved, encoding="utf-8") as handle:
        text = handle.read()
    try:
        defaults = source_defaults(text, class_name)
    except SyntaxError as error:
        raise ValueError(f"{filename} (named by config.json's auto_map) is not valid Python: {error}.") from None
    return defaults, f"{filename}'s {class_name} default"
