"""The house's import rules: no module-level import cycle; the trainer and the parallel code
depend on the model contract, never on the zoo; the typed-config machinery imports no JAX."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "eqxzoo": ROOT / "src" / "eqxzoo",
    "models": ROOT / "models",
    "pipelines": ROOT / "pipelines",
}


def module_files() -> dict[str, Path]:
    files = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = [
                p for p in path.relative_to(directory).with_suffix("").parts if p != "__init__"
            ]
            files[".".join([package, *parts])] = path
    return files


def module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports at module level (not inside functions)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                imported.add(name)
    return imported


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: module_level_imports(path, set(files)) - {name} for name, path in files.items()}


def test_no_module_level_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for dependency in sorted(graph[module]):
            if state.get(dependency) == "open":
                cycle = trail[trail.index(dependency) :] + [dependency]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dependency not in state:
                visit(dependency, trail + [dependency])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_trainer_and_parallel_code_do_not_reach_the_zoo():
    """Not even through another module: they know models by the contract (`eqxzoo.nn`)."""
    graph = import_graph()

    def reachable(module: str) -> set[str]:
        seen, todo = set(), [module]
        while todo:
            for dependency in graph[todo.pop()] - seen:
                seen.add(dependency)
                todo.append(dependency)
        return seen

    contract_only = [
        "eqxzoo.train.settings",
        "eqxzoo.train.state",
        "eqxzoo.train.layout",
        "eqxzoo.train.loss",
        "eqxzoo.train.step",
        "eqxzoo.parallel.pipeline",
        "eqxzoo.parallel.rules",
        "eqxzoo.nn.contract",
    ]
    for name in contract_only:
        zoo = sorted(m for m in reachable(name) if m.split(".")[0] in ("models", "pipelines"))
        assert not zoo, f"{name} reaches {zoo}"
    assert any(m.startswith("models") for m in reachable("eqxzoo.config")), "the check sees"


def test_typed_config_reaches_no_jax_module():
    graph = import_graph()
    assert graph["eqxzoo.typed_config"] <= {"eqxzoo.errors"}
