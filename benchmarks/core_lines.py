"""How many of our lines a script pulls in: the script and every module of ours it imports, at the top or inside a
function (a lazy import counts: a reader copying the script needs it), followed through those modules, each counted
whole.

    python benchmarks/core_lines.py train_grpo.py train_ppo.py

Ours are the .py files at the repository's top level; the libraries are not counted."""
import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def our_imports(path: Path, ours: set[str]) -> set[str]:
    """The modules of ours a file imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & ours


def reached(script: str, repo: Path = REPO) -> dict[str, int]:
    """{module file: its lines} for the script and everything of ours it reaches."""
    ours = {path.stem for path in repo.glob("*.py")}
    lines, todo = {}, [Path(script).stem]
    while todo:
        name = todo.pop()
        path = repo / f"{name}.py"
        if path.name in lines:
            continue
        lines[path.name] = len(path.read_text(encoding="utf-8").splitlines())
        todo += sorted(our_imports(path, ours) - {Path(f).stem for f in lines})
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="+", help="scripts at the repository's top level")
    for script in parser.parse_args().scripts:
        lines = reached(script)
        print(f"{script}: {sum(lines.values())} lines in {len(lines)} files")
        for name, count in sorted(lines.items(), key=lambda item: -item[1]):
            print(f"  {count:6d}  {name}")


if __name__ == "__main__":
    main()
