"""The package's shape: layered subpackages, no import cycle, no hidden function-local imports, optional
packages imported only where they are needed, and nothing but the library inside it (the experiment harness and
benchmark instrumentation live in scripts/).

Read from the source with `ast` (nothing is imported), so a violation names the file and line.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_cfp"

# Each layer imports only from layers before it (and from itself).
# `geometry` (one package per structure of F, each whole: math, estimate sink, artifact part, binding, per-step state,
# LoRA rules; the one registry of structures) sits below `anchor` and `fisher`, which look a structure's parts up in
# it (the anchor artifact reads each geometry's keys, checks and lazy reads; the scoring pass hands what it computes
# to the sinks the structure registered), and below `protection`, which binds the geometries and composes their
# per-step states beside the path: the states read the bound records through `geometry.base`'s protocols, so no
# geometry module imports a layer above it.
LAYERS = [
    ("version", "errors", "exports", "imports", "quiet", "names", "quantized"),
    ("ops",),
    ("parallel",),
    ("geometry",),
    ("anchor",),
    ("fisher",),
    ("protection",),
    ("evaluation",),
    ("loading",),  # models and prompt sets the CLI, the launcher and the demo load
    ("integrations",),
    ("demo",),
    ("launch",),
    ("cli",),
    ("__init__",),
]
LAYER_OF = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}

# Optional heavy dependencies may be imported inside a function, with a comment saying why.
LAZY_ALLOWED = {"deepspeed", "peft", "matplotlib", "bitsandbytes"}

# Packages outside the core install (pyproject's extras; hf_cfp/imports.py probes them), and the only modules
# that may import them at module level: the launcher behind `hf-cfp train` (the `trl` extra) and the Axolotl
# plugin, which Axolotl itself loads. Everywhere else they are imported inside the function that needs them.
OPTIONAL = {"trl", "datasets", "peft", "deepspeed", "bitsandbytes", "matplotlib", "gguf", "axolotl", "pydantic"}
TOP_LEVEL_OPTIONAL = {
    "hf_cfp.launch.train": {"trl"},
    "hf_cfp.launch.sources": {"trl", "datasets"},
    "hf_cfp.launch.axolotl": {"axolotl", "pydantic"},
}

# Modules allowed over MAX_LINES, with the reason.
MAX_LINES = 350
LONG_MODULES: dict[str, str] = {}

# Functions (and methods) whose body, docstring excluded, is over MAX_FUNCTION_LINES, with the reason; keyed
# "module:qualified name", e.g. "hf_cfp.fisher.estimate:estimate_fisher".
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS: dict[str, str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: Path):
    """(node, inside a function) for every import in `path`, skipping `if TYPE_CHECKING:` blocks."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if is_type_checking_block(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def package_targets(module: str, node: ast.AST) -> list[str]:
    """The hf_cfp modules an import statement loads (a submodule if named, else the package)."""
    is_package = MODULES[module].name == "__init__.py"
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "hf_cfp"]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "hf_cfp":
        return []
    targets = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
    if len(targets) < len(node.names):  # some names are attributes of `source` itself
        targets.append(source)
    return [t for t in targets if t != module]


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        graph[module] = {t for node, _ in imports(path) for t in package_targets(module, node)}
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF["__init__" if len(parts) == 1 else parts[1]]


def test_every_module_has_a_layer():
    assert all(layer(m) >= 0 for m in MODULES)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a] (depth-first search), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_on_known_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_point_down_the_layers():
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in import_graph().items()
        for target in targets
        if layer(target) > layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_function_local_imports_are_optional_dependencies_with_a_reason():
    problems = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node, in_function in imports(path):
            if not in_function:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            roots = {name.split(".")[0] for name in names}
            context = lines[max(0, node.lineno - 3) : node.lineno]
            if not roots <= LAZY_ALLOWED:
                problems.append(f"{path.name}:{node.lineno} imports {names} inside a function")
            elif not any("#" in line for line in context):
                problems.append(f"{path.name}:{node.lineno} imports {names} lazily without a comment saying why")
    assert not problems, "\n".join(problems)


def test_optional_packages_are_imported_at_module_level_only_by_the_launcher():
    problems = []
    for module, path in MODULES.items():
        for node, in_function in imports(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            roots = {name.split(".")[0] for name in names if not getattr(node, "level", 0)} & OPTIONAL
            if roots and not in_function and not roots <= TOP_LEVEL_OPTIONAL.get(module, set()):
                problems.append(f"{path.name}:{node.lineno} imports {sorted(roots)} at module level")
    assert not problems, "\n".join(problems)


def test_the_package_holds_no_experiment_harness_or_benchmark_instrumentation():
    """They live in scripts/ (imported there as `evidence` and `benchkit`), outside what `pip install` ships."""
    assert not (PACKAGE / "evidence").exists() and not (PACKAGE / "resident.py").exists()
    scripts = PACKAGE.parent / "scripts"
    assert (scripts / "evidence" / "__init__.py").is_file() and (scripts / "benchkit" / "__init__.py").is_file()
    for module, path in MODULES.items():
        for node, _ in imports(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not {n.split(".")[0] for n in names} & {"evidence", "benchkit"}, f"{module} imports {names}"


def test_modules_stay_small():
    long = {
        module: len(path.read_text().splitlines())
        for module, path in MODULES.items()
        if len(path.read_text().splitlines()) > MAX_LINES and module not in LONG_MODULES
    }
    assert not long, f"modules over {MAX_LINES} lines without a reason in LONG_MODULES: {long}"


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement of a function's body after its docstring to the end of its last one
    (comments and blank lines between them count)."""
    body = node.body
    if (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    if not body:
        return 0
    end = body[-1].end_lineno
    assert end is not None
    return end - body[0].lineno + 1


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method in `tree`, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def test_body_lines_skip_the_docstring_and_count_to_the_last_statement():
    source = 'def f():\n    """Doc,\n    two lines."""\n    a = 1\n\n    # a comment\n    return a\n'
    ((name, node),) = functions(ast.parse(source))
    assert name == "f" and body_lines(node) == 4
    nested = "class A:\n    def m(self):\n        def inner():\n            pass\n        return inner\n"
    assert [(n, body_lines(f)) for n, f in functions(ast.parse(nested))] == [("A.m", 3), ("A.m.inner", 1)]


def test_functions_stay_short():
    long = {
        key: lines
        for module, path in MODULES.items()
        for name, node in functions(ast.parse(path.read_text()))
        if (lines := body_lines(node)) > MAX_FUNCTION_LINES and (key := f"{module}:{name}") not in LONG_FUNCTIONS
    }
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (docstring excluded) without a reason in LONG_FUNCTIONS: {long}"
    )


def test_long_function_reasons_name_functions_that_exist():
    existing = {
        f"{module}:{name}" for module, path in MODULES.items() for name, _ in functions(ast.parse(path.read_text()))
    }
    assert set(LONG_FUNCTIONS) <= existing, (
        f"LONG_FUNCTIONS names functions that do not exist: {set(LONG_FUNCTIONS) - existing}"
    )
