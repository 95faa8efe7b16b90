"""The package's shape, read from the source with `ast` (imports no jax, runs in milliseconds).

Issue 28's structure targets: the longest import chain inside `hetero_jax/serving/` is at
most 5 modules (dedicated mode, replicas and Ray replicas are siblings over
`serving.processes`, not a stack), and no module reaches into another's private names, by
`from x import _y` or by `x._y` / `SomeClass._y` on a name it imported.
"""
import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "hetero_jax"
MAX_SERVING_CHAIN = 5


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imported(path: pathlib.Path, name: str | None = None) -> list:
    """(module, name or None) for every import in the file (module `name`, by default its
    own), functions' own included; a relative import is resolved against its package."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return out


def serving_deps(name: str) -> set:
    """The `serving` modules that `name` imports (`from hetero_jax.serving import x` too)."""
    deps = set()
    for base, item in imported(MODULES[name]):
        for candidate in (f"{base}.{item}", base):
            if candidate in MODULES and candidate.startswith("hetero_jax.serving.") \
                    and candidate != name:
                deps.add(candidate)
                break
    return deps


@functools.lru_cache(maxsize=None)
def longest_chain(name: str) -> tuple:
    """The longest import chain that starts at `name`, as module names."""
    tails = [longest_chain(dep) for dep in serving_deps(name)]
    return (name,) + max(tails, key=len, default=())


def private_uses(path: pathlib.Path, name: str | None = None) -> list:
    """`from x import _y` from a hetero_jax module, and `a._y` where `a` is a name this
    module imported from hetero_jax (a module or a class): what reaches into another
    module's private names."""
    found, bound = [], set()
    for base, item in imported(path, name):
        if not base.startswith("hetero_jax"):
            continue
        if item is not None and item.startswith("_"):
            found.append(f"from {base} import {item}")
        bound.add((item or base).split(".")[0])
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in bound and node.attr.startswith("_") and \
                not node.attr.startswith("__"):
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return found


def test_chain_counts_a_known_graph():
    """The chain is counted in modules: engine -> input_processor (or drive) is 2."""
    assert longest_chain("hetero_jax.serving.input_processor") == (
        "hetero_jax.serving.input_processor",)
    chain = longest_chain("hetero_jax.serving.engine")
    assert len(chain) == 2, f"{chain=}"


def test_serving_import_chain_is_short():
    serving = [m for m in MODULES if m.startswith("hetero_jax.serving.")]
    assert len(serving) > 10, f"{serving=}"
    chain = max((longest_chain(m) for m in serving), key=len)
    assert len(chain) <= MAX_SERVING_CHAIN, f"{len(chain)} modules: {' -> '.join(chain)}"


def test_no_private_name_crosses_modules():
    found = {name: private_uses(path) for name, path in sorted(MODULES.items())}
    found = {name: uses for name, uses in found.items() if uses}
    assert not found, f"private names used across modules: {found}"


def test_private_use_is_detected(tmp_path):
    """The check sees both forms it looks for (a guard against a check that finds nothing)."""
    source = ("from hetero_jax.serving.processes import _x\n"
              "from hetero_jax.serving.dedicated import DedicatedEngine\n"
              "DedicatedEngine._renumber(1)\nDedicatedEngine.__name__\n")
    path = tmp_path / "probe.py"
    path.write_text(source)
    uses = private_uses(path, "hetero_jax.serving.probe")
    assert uses == ["from hetero_jax.serving.processes import _x",
                    "DedicatedEngine._renumber (line 3)"], f"{uses=}"
