"""Imports run one way: no two of the project's files import each other, directly or through others. An import
inside a function counts too (it is a circle all the same, only deferred)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OURS = {path.stem for path in REPO.glob("*.py")}
_spec = importlib.util.spec_from_file_location("core_lines", REPO / "benchmarks" / "core_lines.py")
core_lines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(core_lines)


def our_imports(path: Path) -> set[str]:
    return core_lines.our_imports(path, OURS) - {path.stem}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a list of files, the first repeated at the end), or None."""
    state = {}  # file -> "open" while on the path, "done" after

    def visit(name, path):
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (circle := visit(imported, path + [imported])):
                return circle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state and (circle := visit(name, [name])):
            return circle
    return None


def test_the_circle_finder_finds_a_circle_through_others():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_two_files_import_each_other_directly_or_through_others():
    graph = {path.stem: our_imports(path) for path in REPO.glob("*.py")}
    assert find_circle(graph) is None
    # What the README's layout section states, file by file.
    assert graph["common"] == graph["official"] == graph["rule_user"] == graph["vllm_backends"] == set()
    assert graph["guards"] == {"common"} and graph["preflight"] == {"common", "guards", "vllm_backends"}
    assert graph["generation"] == {"common", "guards", "vllm_backends"} and graph["chat_client"] == {"common", "guards"}
    assert graph["simulator"] == {"common", "guards", "official", "rule_user"}
    assert graph["llm_user"] == {"chat_client", "common", "guards", "official", "simulator"}
    assert graph["rollout"] == {"common", "generation", "guards", "llm_user", "simulator"}
    assert all({"rollout", "preflight"} <= graph[trainer] for trainer in ("train_grpo", "train_ppo"))
    assert "rollout" in graph["eval_sentient"] and "chat_client" in graph["eval_general"]


def test_the_backends_are_imported_only_by_the_function_that_needs_them():
    """The vLLM backends, the LLM users (with the released prompts) and the chat client load only when asked
    for: no module of ours imports them when it is imported."""
    on_start = {path.stem: core_lines.our_imports(path, OURS, lazy=False) - {path.stem} for path in REPO.glob("*.py")}
    backends = {"vllm_backends", "llm_user", "official"}
    assert {name: imported & backends for name, imported in on_start.items()
            if imported & backends and name not in backends} == {}


def test_the_line_count_follows_lazy_imports_through_our_modules_and_counts_each_file_once(tmp_path):
    (tmp_path / "script.py").write_text("import json\nimport helper\n\n\ndef later():\n    import lazy\n")
    (tmp_path / "helper.py").write_text("from lazy import x\n")
    (tmp_path / "lazy.py").write_text("import helper\nx = 1\n\n")
    (tmp_path / "unused.py").write_text("y = 2\n")
    assert core_lines.reached("script.py", tmp_path) == {"script.py": 6, "helper.py": 1, "lazy.py": 3}


def test_on_start_the_count_leaves_out_what_only_a_function_imports(tmp_path):
    (tmp_path / "script.py").write_text(
        "import helper\n\nif True:\n    import guarded\n\n\ndef later():\n    import lazy\n")
    (tmp_path / "helper.py").write_text("class A:\n    import in_class\n")
    for name in ("guarded", "lazy", "in_class"):
        (tmp_path / f"{name}.py").write_text("x = 1\n")
    assert set(core_lines.reached("script.py", tmp_path, lazy=False)) == {"script.py", "helper.py", "guarded.py",
                                                                          "in_class.py"}
    assert "lazy.py" in core_lines.reached("script.py", tmp_path)
