"""helpers/ is layered as the course is: the machine, then the model, then what uses it; never upwards.

Read from the source (every import, the ones inside functions too), so the check holds whatever a test happens
to import.
"""

import ast
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
# A subpackage may import its own layer's modules and any lower layer; benchmarks and notebook tooling sit on top.
LAYERS = {"system": 0, "model": 1, "text": 2, "training": 3, "inference": 3, "parallel": 4, "serving": 4, "measure": 5,
          "manifest": 6, "notebooks": 6, "exercises": 6, "__main__": 6, "__init__": 6}


def module_name(path: Path) -> str:
    parts = path.relative_to(HELPERS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    """`from helpers.model import gpt` imports a module; `from helpers.model.gpt import GPT` a name."""
    path = HELPERS.parent / dotted.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The statements under `if TYPE_CHECKING:`: read by type checkers, never run."""
    return {node for branch in ast.walk(tree) if isinstance(branch, ast.If) and ast.unparse(branch.test).endswith(
        "TYPE_CHECKING") for statement in branch.body for node in ast.walk(statement)}


def imports(path: Path, runtime: bool = False) -> list[tuple[str, list[str]]]:
    """(imported helpers module, names taken from it) for every import statement in the file; `runtime`: only
    those that run (not the ones under `if TYPE_CHECKING:`)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    tree = ast.parse(path.read_text())
    skipped = type_checking_only(tree) if runtime else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "helpers":
                names = [alias.name for alias in node.names]
                submodules = [f"{target}.{n}" for n in names if is_module(f"{target}.{n}")]
                found += [(m, []) for m in submodules] or [(target, names)]
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "helpers"]
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


SOURCES = {module_name(p): p for p in sorted(HELPERS.rglob("*.py"))}
GRAPH = {name: imports(path) for name, path in SOURCES.items()}


def test_every_subpackage_has_a_layer():
    assert {m.split(".")[1] for m in SOURCES if "." in m} <= set(LAYERS)


def test_no_module_imports_a_higher_layer():
    upward = [f"{name} imports {target}" for name, targets in GRAPH.items() for target, _ in targets
              if target != "helpers" and layer(target) > layer(name)]
    assert not upward, upward


def test_the_import_graph_is_acyclic():
    """At run time: a part annotates with GPTConfig under TYPE_CHECKING while the config validates against the
    part registry."""
    runtime = {name: imports(path, runtime=True) for name, path in SOURCES.items()}
    edges = {name: {t for t, _ in targets if t in SOURCES and t != name and not t.endswith("__init__")}
             for name, targets in runtime.items() if not name.count(".") == 0}
    edges = {n: {t for t in ts if t in edges} for n, ts in edges.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_no_private_name_crosses_a_module():
    crossing = [f"{name} imports {n} from {target}" for name, targets in GRAPH.items() for target, names in targets
                for n in names if n.startswith("_") and target != name]
    assert not crossing, crossing


def test_the_model_package_imports_only_the_machine_layer():
    """The model is the bottom of the course: it may use system helpers, nothing that trains, serves or measures."""
    for name, targets in GRAPH.items():
        if name.startswith("helpers.model"):
            assert all(t.split(".")[1] in ("model", "system") for t, _ in targets if "." in t), (name, targets)
