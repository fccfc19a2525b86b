"""Sphinx configuration of the Python API reference; `bash scripts/api-docs.sh` builds it
into target/api-docs/ from the installed package.

The Python modules are documented from their docstrings. The compiled module
``shmbridge._native`` (Client, Engine, EngineSpec, Tensor, ...) is documented from its
stub ``python/shmbridge/_native.pyi``, what type checkers and editors read: each of its
objects gets the stub's signature and docstring, not those compiled in from the Rust
source. ``nitpicky`` with ``-W``: a reference in a docstring that resolves to nothing
fails the build."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sphinx.ext.napoleon import Config as GoogleStyle
from sphinx.ext.napoleon.docstring import GoogleDocstring

import shmbridge

project = "shmbridge"
version = release = shmbridge.__version__
extensions = ["sphinx.ext.autodoc"]
nitpicky = True
# Types from other projects (no intersphinx: the build runs offline) and the typing
# module's helpers are not ours to resolve.
nitpick_ignore_regex = [
    ("py:class", r"(numpy|np|torch|gymnasium|jax|types|typing|collections\.abc|concurrent\.futures)\..*"),
    ("py:class", r"(Any|Callable|Dict|List|Literal|Optional|Protocol|Sequence|Tuple|Type|Union|Iterator|Iterable|Mapping)"),
    ("py:class", r"(np\.ndarray|TracebackType|EngineProcess|_StepResult|_EngineProcess|_CommandHandler|EnvTarget)"),
    # The compiled half of Observer, which only observe() makes.
    ("py:class", r"shmbridge\._native\.RawObserver"),
    ("py:attr", r"AutoresetMode\..*"),
]
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"
html_static_path: list = []
exclude_patterns = ["_build"]


def _stub_entries(path: Path) -> dict:
    """``{qualified name: (signature, return annotation, docstring)}`` of the stub's
    classes, functions, methods and properties."""
    entries = {}

    def signature(node: ast.FunctionDef, method: bool) -> tuple:
        args = node.args
        if method and not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
            positional = args.posonlyargs or args.args
            if positional:
                args = ast.arguments(
                    posonlyargs=args.posonlyargs[1:] if args.posonlyargs else [],
                    args=args.args if args.posonlyargs else args.args[1:],
                    vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                    kwarg=args.kwarg, defaults=args.defaults)
        returns = ast.unparse(node.returns) if node.returns is not None else None
        return f"({ast.unparse(args)})", returns

    def visit(body, prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = prefix + node.name
                entries[name] = (None, None, ast.get_docstring(node))
                visit(node.body, name + ".", True)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sig, ret = signature(node, in_class)
                entries[prefix + node.name] = (sig, ret, ast.get_docstring(node))

    visit(ast.parse(path.read_text()).body, "", False)
    return entries


_STUB = _stub_entries(Path(inspect.getfile(shmbridge)).with_name("_native.pyi"))


def _stub_name(obj) -> "str | None":
    """The stub's name of ``obj`` when it is an object of the compiled module."""
    if isinstance(obj, property) or type(obj).__name__ == "getset_descriptor":
        owner = getattr(obj, "__objclass__", None)
        name = getattr(obj, "__name__", None) or getattr(getattr(obj, "fget", None), "__name__", None)
        if owner is not None and name and getattr(owner, "__module__", "") == "shmbridge._native":
            return f"{owner.__qualname__}.{name}"
        return None
    if getattr(obj, "__module__", None) == "shmbridge._native" or (
        getattr(getattr(obj, "__objclass__", None), "__module__", None) == "shmbridge._native"):
        return getattr(obj, "__qualname__", None)
    return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _examples_as_code(lines: list) -> None:
    """The docstrings' examples are blocks indented by 4 or more after a blank line (as
    ``help()`` shows them); reST would read them as quotes, so each becomes a literal
    block."""
    out, base, in_code = [], 0, False
    for i, line in enumerate(lines):
        blank = not line.strip()
        if in_code and not blank and _indent(line) <= base:
            in_code = False
        if not in_code and not blank and i > 0 and not lines[i - 1].strip() and out:
            previous = next((l for l in reversed(out) if l.strip() and l.strip() != "::"), "")
            if _indent(line) >= _indent(previous) + 4 and not previous.rstrip().endswith("::"):
                base, in_code = _indent(previous), True
                out[-1:] = ["", "::", ""]
        if not blank and not in_code:
            base = _indent(line)
        out.append(line)
    lines[:] = out


def _docstring(app, what, name, obj, options, lines) -> None:
    stub = _STUB.get(_stub_name(obj) or "")
    if stub is not None:
        lines[:] = (stub[2] or "").splitlines()
    _examples_as_code(lines)
    # "Args:" sections (Google style) become fields; a property's docstring is prose (the
    # napoleon extension would read "Address of ...: ..." as a type).
    if what not in ("attribute", "data", "property"):
        lines[:] = GoogleDocstring(lines, GoogleStyle(), app, what, name, obj, options).lines()


def _signature(app, what, name, obj, options, signature, return_annotation):
    stub = _STUB.get(_stub_name(obj) or "")
    if what in ("function", "method", "class") and stub is not None and stub[0] is not None:
        return stub[0], stub[1]
    return None


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _docstring)
    app.connect("autodoc-process-signature", _signature)
