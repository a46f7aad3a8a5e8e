"""A copy of the method without the guards, made by the rule docs/copying.md gives a teacher: the files the trainers
load on start (benchmarks/core_lines.py) but guards.py and preflight.py, with prompts/ and profiles/, and in each file
that imports the layer at its top:

- every simple statement (a line with its continuation lines) that names `guards` or `preflight` is deleted, the
  imports included, and so are the comment lines right above it;
- in a `with` statement, an item that names them is dropped; one left with no item is replaced by its body;
- a block left empty goes with its header (an `if`, a function).

    python benchmarks/teaching_copy.py DIR      # writes the copy into DIR (new or empty) and prints its lines

A file that imports the layer only inside a function (generation.py's loader of the evaluations' model) is copied as
it is: the copy trains without that function. tests/test_teaching_copy.py trains a GRPO step and a PPO step in such a
copy."""
import argparse
import ast
import importlib.util
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYER = {"guards", "preflight"}
_spec = importlib.util.spec_from_file_location("core_lines", REPO / "benchmarks" / "core_lines.py")
core_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core_lines)


def method_files() -> list[str]:
    """What the trainers load on start, the layer aside."""
    loaded = {name for script in ("train_grpo.py", "train_ppo.py") for name in core_lines.reached(script, lazy=False)}
    return sorted(loaded - {f"{name}.py" for name in LAYER})


def names_layer(node: ast.AST) -> bool:
    return any(isinstance(part, ast.Name) and part.id in LAYER or isinstance(part, ast.alias)
               and part.name.split(".")[0] in LAYER or isinstance(part, ast.ImportFrom) and part.module in LAYER
               for part in ast.walk(node))


class Removal:
    """The edits of one file, found by walking its statements, then applied to its lines (comments stay)."""

    def __init__(self, source: str):
        self.lines = source.splitlines(keepends=True)
        self.deleted: set[int] = set()  # 0-based line numbers
        self.dedents: list[tuple[int, int, int]] = []  # (first line, last line, columns)
        self.cuts: list[tuple[int, int, int, int]] = []  # (line, column) to (line, column), header text dropped
        self.body(ast.parse(source).body)

    def delete(self, node: ast.stmt) -> None:
        first = min([node.lineno] + [item.lineno for item in getattr(node, "decorator_list", [])]) - 1
        while first > 0 and self.lines[first - 1].strip().startswith("#"):
            first -= 1
        self.deleted.update(range(first, node.end_lineno))

    def body(self, statements: list[ast.stmt]) -> bool:
        """Whether every statement of a block is deleted."""
        kept = [statement for statement in statements if self.statement(statement)]
        return not kept

    def statement(self, node: ast.stmt) -> bool:
        """Whether `node` stays (perhaps edited)."""
        if isinstance(node, ast.With):
            return self.with_statement(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if self.body(node.body):
                self.delete(node)
                return False
            return True
        if isinstance(node, (ast.If, ast.For, ast.While, ast.Try)):
            if names_layer(getattr(node, "test", None) or getattr(node, "iter", None) or ast.Pass()):
                raise ValueError(f"line {node.lineno}: a block whose header names the layer")
            blocks = [node.body, node.orelse] + [handler.body for handler in getattr(node, "handlers", [])] + \
                [getattr(node, "finalbody", [])]
            emptied = [self.body(block) for block in blocks if block]
            if all(emptied):
                self.delete(node)
                return False
            if any(emptied):
                raise ValueError(f"line {node.lineno}: a block of which only a part is left empty")
            return True
        if names_layer(node):
            self.delete(node)
            return False
        return True

    def with_statement(self, node: ast.With) -> bool:
        if self.body(node.body):
            self.delete(node)
            return False
        layer = [index for index, item in enumerate(node.items) if names_layer(item)]
        if len(layer) == len(node.items):  # the body in the with's place
            header_end = node.body[0].lineno - 1
            while self.lines[header_end - 1].strip().startswith("#"):
                header_end -= 1
            self.deleted.update(range(node.lineno - 1, header_end))
            self.dedents.append((header_end, node.end_lineno - 1, node.body[0].col_offset - node.col_offset))
        for index in layer if len(layer) < len(node.items) else []:
            if index == 0:
                raise ValueError(f"line {node.lineno}: a with statement whose first item names the layer")
            before, item = node.items[index - 1], node.items[index]
            start = before.optional_vars or before.context_expr
            end = item.optional_vars or item.context_expr
            self.cuts.append((start.end_lineno - 1, start.end_col_offset, end.end_lineno - 1, end.end_col_offset))
        return True

    def text(self) -> str:
        lines = list(self.lines)
        for first_line, first_column, last_line, last_column in self.cuts:
            lines[first_line] = lines[first_line][:first_column] + lines[last_line][last_column:]
            self.deleted.update(range(first_line + 1, last_line + 1))
        for first, last, columns in self.dedents:
            for number in range(first, last + 1):
                if lines[number][:columns].strip() == "":
                    lines[number] = lines[number][columns:] if lines[number].strip() else lines[number]
        kept = "".join(line for number, line in enumerate(lines) if number not in self.deleted)
        return re.sub(r"\n{4,}", "\n\n\n", kept)  # a top-level definition gone: two blank lines, not more


def without_layer(source: str) -> str:
    """`source` with the layer's statements removed by the rule; it must still parse and name no part of the layer."""
    text = Removal(source).text()
    left = [node.lineno for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Name) and node.id in LAYER]
    if left:
        raise ValueError(f"the layer is still named on lines {left}")
    return text


def imports_layer_at_top(source: str) -> bool:
    return any(names_layer(node) for node in ast.parse(source).body if isinstance(node, (ast.Import, ast.ImportFrom)))


def make_copy(folder: Path) -> dict[str, int]:
    """Write the copy into `folder`; {file: its lines}."""
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in method_files():
        source = (REPO / name).read_text(encoding="utf-8")
        text = without_layer(source) if imports_layer_at_top(source) else source
        (folder / name).write_text(text, encoding="utf-8")
        counts[name] = len(text.splitlines())
    for data in ("prompts", "profiles"):
        shutil.copytree(REPO / data, folder / data)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a new or empty folder")
    folder = parser.parse_args().folder
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder}: not empty; give a new or empty folder")
    counts = make_copy(folder)
    print(f"{folder}: {sum(counts.values())} lines in {len(counts)} files, prompts/ and profiles/ beside them")
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{count:8d}  {name}")


if __name__ == "__main__":
    main()
