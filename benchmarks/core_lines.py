"""How many of our lines a script pulls in: the script and every module of ours it imports, followed through those
modules, each counted whole. Two counts:
- on start: the imports Python runs when the script starts (a module's top level, its classes' bodies, and
  the `if` and `try` blocks there), which is the default path: an import inside a function is made only by
  the feature that calls it (the vLLM backends, the LLM users), and tests/test_imports.py checks that the
  default demo loads no other module of ours;
- in all: lazy imports too, what a reader copying the script with all its features needs.

    python benchmarks/core_lines.py train_grpo.py train_ppo.py

Ours are the .py files at the repository's top level; the libraries are not counted."""
import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_on_start(node: ast.AST):
    """The nodes Python runs when it imports the module `node` (not the bodies of functions)."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from run_on_start(child)


def our_imports(path: Path, ours: set[str], lazy: bool = True) -> set[str]:
    """The modules of ours a file imports anywhere in it, or (lazy=False) when it is imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = set()
    for node in ast.walk(tree) if lazy else run_on_start(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & ours


def reached(script: str, repo: Path = REPO, lazy: bool = True) -> dict[str, int]:
    """{module file: its lines} for the script and everything of ours it reaches (lazy=False: on start)."""
    ours = {path.stem for path in repo.glob("*.py")}
    lines, todo = {}, [Path(script).stem]
    while todo:
        name = todo.pop()
        path = repo / f"{name}.py"
        if path.name in lines:
            continue
        lines[path.name] = len(path.read_text(encoding="utf-8").splitlines())
        todo += sorted(our_imports(path, ours, lazy) - {Path(f).stem for f in lines})
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="+", help="scripts at the repository's top level")
    for script in parser.parse_args().scripts:
        on_start, in_all = reached(script, lazy=False), reached(script)
        print(f"{script}: {sum(on_start.values())} lines in {len(on_start)} files on start, "
              f"{sum(in_all.values())} in {len(in_all)} with its lazy imports")
        for name, count in sorted(in_all.items(), key=lambda item: -item[1]):
            print(f"  {count:6d}  {name}{'' if name in on_start else '  (lazy)'}")


if __name__ == "__main__":
    main()
