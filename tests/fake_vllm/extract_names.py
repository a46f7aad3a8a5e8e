"""Writes the name lists the fake vllm accepts, read from the Python sources of a real vLLM wheel:

    pip download --no-deps vllm==0.31.0 -d /tmp/w && unzip -q /tmp/w/vllm-0.31.0-*.whl 'vllm/*' -d /tmp/vllm
    python tests/fake_vllm/extract_names.py /tmp/vllm

sampling_fields.txt: the fields of `vllm.SamplingParams` (a msgspec Struct: its annotated class fields).
engine_args.txt: the keyword names `vllm.LLM(...)` accepts: its own `__init__` keywords plus the fields of
`EngineArgs` (LLM passes unknown keywords on to EngineArgs, which refuses names it does not have)."""
import ast
import sys
from pathlib import Path


def class_fields(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return [item.target.id for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            and not (isinstance(item.annotation, ast.Subscript) and getattr(item.annotation.value, "id", "") == "ClassVar")]


def init_keywords(path: Path, name: str) -> list[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]


def main(root: str) -> None:
    root = Path(root) / "vllm"
    here = Path(__file__).parent
    version = (root / "_version.py").read_text().split("__version__ = version = ")[1].split("\n")[0].strip("'\"")
    sampling = class_fields(root / "sampling_params.py", "SamplingParams")
    engine = sorted(set(init_keywords(root / "entrypoints" / "llm.py", "LLM")[1:])  # [1:]: not `model`
                    | set(class_fields(root / "engine" / "arg_utils.py", "EngineArgs")))
    header = f"# read from the vllm {version} wheel by tests/fake_vllm/extract_names.py\n"
    (here / "sampling_fields.txt").write_text(header + "\n".join(sampling) + "\n")
    (here / "engine_args.txt").write_text(header + "\n".join(engine) + "\n")
    print(version, len(sampling), "sampling fields,", len(engine), "engine arguments")


if __name__ == "__main__":
    main(sys.argv[1])
