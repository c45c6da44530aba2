"""The "Taught in lab NN" back-links of labkit's docstrings, checked against the labs' sources as d2l generates its
own: every labkit function or class a lab calls names that lab, and no docstring names a lab that never calls it.

The labs are read, never run, and labkit is read, never imported: the check costs a second.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "labkit"
NOTEBOOK_DIR = REPO_ROOT / "notebooks"

TAUGHT = re.compile(r"Taught in labs? (\d\d(?:(?:, | and )\d\d)*)\.")
"""The back-link a labkit docstring ends with: "Taught in lab 07." or "Taught in labs 01, 02 and 04."."""


def taught_phrase(labs) -> str:
    """The back-link naming `labs` (two-digit numbers), as TAUGHT reads it."""
    labs = sorted(labs)
    if len(labs) == 1:
        return f"Taught in lab {labs[0]}."
    return f"Taught in labs {', '.join(labs[:-1])} and {labs[-1]}."


def _module_file(module: str, package: Path) -> Path | None:
    """The source file of a labkit module (`package` is labkit's folder), or None when `module` is not one."""
    base = package.parent.joinpath(*module.split("."))
    return next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()), None)


@functools.lru_cache(maxsize=None)
def _module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _home(module: str, name: str, package: Path) -> str | None:
    """Where labkit defines what `module` calls `name` (module.name), following its re-exports; None when it is not
    a function or class of labkit's."""
    path = _module_file(module, package)
    if path is None:
        return None
    for node in _module_tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return f"{module}.{name}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "labkit":
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _home(node.module, alias.name, package)
    return None


def labkit_calls(source: str, package: Path | str | None = None) -> set[str]:
    """Where labkit defines each function or class a notebook's code calls (module.name): a name imported from labkit
    (`from labkit.x import f`, then `f(...)`) or an attribute of an imported labkit module (`views.f(...)`). Read from
    the sources alone, nothing imported."""
    package = Path(package) if package is not None else PACKAGE
    tree = ast.parse(source)
    names: dict[str, tuple[str, str]] = {}
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "labkit":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if _module_file(submodule, package):
                    modules[alias.asname or alias.name] = submodule
                else:
                    names[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            modules.update({alias.asname or alias.name: alias.name for alias in node.names
                            if alias.name.split(".")[0] == "labkit"})
    called = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in names:
            called.add(_home(*names[node.func.id], package))
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in modules:
            called.add(_home(modules[node.func.value.id], node.func.attr, package))
    return called - {None}


def taught_in(notebook_dir: Path | str | None = None) -> dict[str, set[str]]:
    """{where labkit defines a function or class (module.name): the labs that call it}, read from the labs' jupytext
    sources (NN_name.py): what each docstring's "Taught in" back-link must say."""
    notebook_dir = Path(notebook_dir) if notebook_dir is not None else NOTEBOOK_DIR
    labs: dict[str, set[str]] = {}
    for path in sorted(notebook_dir.glob("[0-9][0-9]_*.py")):
        for home in labkit_calls(path.read_text(encoding="utf-8")):
            labs.setdefault(home, set()).add(path.name[:2])
    return labs


def taught_links(package: Path | str | None = None) -> dict[str, set[str]]:
    """{home of a function or class in labkit's source: the labs its docstring's "Taught in" back-link names}, read
    from the source without importing it."""
    package = Path(package) if package is not None else PACKAGE
    links = {}
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = [(node, module) for node in tree.body]
        while scopes:
            node, prefix = scopes.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                home = f"{prefix}.{node.name}"
                found = TAUGHT.search(" ".join((ast.get_docstring(node) or "").split()))
                if found:
                    links[home] = set(re.findall(r"\d\d", found.group(1)))
                if isinstance(node, ast.ClassDef):
                    scopes += [(child, home) for child in node.body]
    return links
