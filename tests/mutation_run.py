"""Mutation testing of the functions where RL code goes silently wrong: are the tests sharp enough?

    python tests/mutation_run.py                 # every target; docs/testing.md has the figures
    python tests/mutation_run.py --only ppo_losses,masked_gae --workers 2
    python tests/mutation_run.py --list          # the mutants, without running anything

Each mutant is one small change in one target function, of the kinds that make RL code wrong without
crashing it: a comparison moved by one (`<` -> `<=`), an operator swapped (`+` -> `-`, `*` -> `/`), `max` ->
`min`, a sign dropped, a constant moved by one, `and` -> `or`, `True` -> `False`, a call's result replaced by
its first argument (an escape or a clamp removed). The mutated file is written into a scratch copy of the
repository, the target's tests run there (`pytest -x`), and the mutant is killed if they fail or time out.
A survivor is either a missing test or an equivalent mutant (one that cannot change behaviour): list it in
docs/testing.md with the reason.
"""
import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (file, function or Class.method, the tests that must catch a wrong version of it). Fast unit tests only:
# every mutant runs them once.
PPO = "tests/test_train_ppo.py"
ROLLOUT = "tests/test_rollout.py"
REPORT = ["tests/test_report.py", "-k", "not screenshot and not real_rollout"]
SANDBOX = "sandbox or network or namespace or unshare or loop or memory or limits or grow or cut_at"
TARGETS = [
    ("train_ppo.py", "ppo_losses", [PPO, "-k", "policy_loss_is or value_loss_is or entropy_bonus or clip_fraction "
                                               "or masked_tokens_contribute"]),
    ("train_ppo.py", "masked_gae", [PPO, "-k", "gae or values_on_user_tokens"]),
    ("train_ppo.py", "whiten", [PPO, "-k", "blank_critic or whiten"]),
    ("train_ppo.py", "masked_mean", [PPO, "-k", "masked_mean or mean_over or masked_tokens or policy_loss_is "
                                                "or value_loss_is"]),
    ("train_ppo.py", "place_rewards", [PPO, "tests/test_turn_credit.py", "-k", "rewards_land or kl_penalty or lands_on "
                                       "or puts_each or format_penalty"]),
    ("train_ppo.py", "turn_rewards", ["tests/test_turn_credit.py", "-k", "lands_on or puts_each or format_penalty "
                                      "or return"]),
    ("train_ppo.py", "dialogue_rows", ["tests/test_turn_credit.py", "-k", "lands_on or puts_each or return"]),
    ("train_grpo.py", "turn_terms", ["tests/test_turn_credit.py", "-k", "turn_terms or no_other or group_baseline"]),
    ("train_grpo.py", "token_advantages", ["tests/test_turn_credit.py", "-k", "token_advantages"]),
    ("rollout.py", "Dialogue.turn_changes", ["tests/test_turn_credit.py", "-k", "turn_changes or return"]),
    ("rollout.py", "Dialogue.sampled_turn", ["tests/test_turn_credit.py", "-k", "sampled_turn or lands_on or puts_each"]),
    ("train_ppo.py", "state_values", [PPO, "-k", "value_of_an_action or old_values_are"]),
    ("rollout.py", "reward", [ROLLOUT, "-k", "reward_is_final"]),
    ("rollout.py", "dialogue_metrics", [ROLLOUT, "tests/test_train_grpo.py", "-k", "metrics or reward_reads"]),
    ("generation.py", "split_think", [ROLLOUT, "-k", "split_think"]),
    ("rollout.py", "Dialogue.append", [ROLLOUT, "-k", "env_mask or masked_in"]),
    ("rollout.py", "DialogueRunner._sample", [ROLLOUT, "-k", "env_mask or thinking_ or token_budget or never_receives"]),
    ("rollout.py", "DialogueRunner._cut_thought", [ROLLOUT, "-k", "env_mask or thinking_ or never_receives"]),
    ("rollout.py", "DialogueRunner._answer", [ROLLOUT, "-k", "token_budget or fails_ends or ended_early or inserted "
                                                             "or simulator_time or goes_on_exactly"]),
    ("simulator.py", "Simulator.respond", [
        "tests/test_llm_simulator.py", "tests/test_rule_simulator.py", "-k",
        "bound or clamp or floored or below_ten or one_hundred or turn_limit or goodbye or two_calls or ten_is "
        "or responding_after or dialogue_ends"]),
    ("simulator.py", "parse_analysis", ["tests/test_analysis_format.py"]),
    ("eval_sentient.py", "summarize", ["tests/test_eval_sentient.py", "-k", "success_ or metrics_on or rescore_prints "
                                       "or bootstrap or nine_judged"]),
    ("eval_sentient.py", "judged_replies", ["tests/test_eval_sentient.py", "-k", "success_needs or metrics_on "
                                            "or rescore_prints or nine_judged"]),
    ("report.py", "conversation", REPORT),
    ("report.py", "dialogue_block", REPORT),
    ("report.py", "filters", REPORT),
    ("report.py", "summary_figures", REPORT),
    ("report.py", "first_divergence", REPORT),
    ("eval_general.py", "network_namespace", ["tests/test_eval_general.py", "-k", SANDBOX]),
    ("eval_general.py", "run_sandboxed", ["tests/test_eval_general.py", "-k", SANDBOX + " or humaneval_solution"]),
]

SWAP_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
SWAP_BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
               ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
REMOVABLE = {"escape", "clamp", "clip", "abs", "exp", "detach", "strip", "round", "sqrt"}
SWAP_NAMES = {"max": "min", "min": "max", "any": "all", "all": "any", "amax": "amin", "amin": "amax"}


class Mutator(ast.NodeTransformer):
    """Counts the mutation sites inside the target; with `apply` set, changes the one with that index."""

    def __init__(self, target: str, apply: int | None = None):
        self.path, self.apply, self.count, self.inside = target.split("."), apply, 0, 0
        self.description = None
        self.scope = []

    def _site(self, node, mutated, description):
        index, self.count = self.count, self.count + 1
        if index == self.apply:
            self.description = f"line {node.lineno}: {description}"
            return ast.copy_location(mutated, node)
        return node

    def _scoped(self, node):
        self.scope.append(node.name)
        hit = self.path == ["*"] or self.scope[-len(self.path):] == self.path and len(self.scope) == len(self.path)
        self.inside += hit
        self.generic_visit(node)
        self.inside -= hit
        self.scope.pop()
        return node

    visit_FunctionDef = visit_ClassDef = visit_AsyncFunctionDef = _scoped

    def visit_Compare(self, node):
        self.generic_visit(node)
        if self.inside and type(node.ops[0]) in SWAP_COMPARE:
            new = SWAP_COMPARE[type(node.ops[0])]
            mutated = ast.Compare(node.left, [new()] + node.ops[1:], node.comparators)
            return self._site(node, mutated, f"{type(node.ops[0]).__name__} -> {new.__name__}")
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        if self.inside and type(node.op) in SWAP_BINARY:
            new = SWAP_BINARY[type(node.op)]
            return self._site(node, ast.BinOp(node.left, new(), node.right), f"{type(node.op).__name__} -> {new.__name__}")
        return node

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if self.inside and isinstance(node.op, (ast.USub, ast.Not)):
            return self._site(node, node.operand, f"drop {type(node.op).__name__}")
        return node

    def visit_BoolOp(self, node):
        self.generic_visit(node)
        if self.inside:
            new = ast.Or if isinstance(node.op, ast.And) else ast.And
            return self._site(node, ast.BoolOp(new(), node.values), f"{type(node.op).__name__} -> {new.__name__}")
        return node

    def visit_Constant(self, node):
        if self.inside and isinstance(node.value, bool):
            return self._site(node, ast.Constant(not node.value), f"{node.value} -> {not node.value}")
        if self.inside and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return self._site(node, ast.Constant(node.value + 1), f"{node.value} -> {node.value + 1}")
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if not self.inside:
            return node
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in SWAP_NAMES:
            func = (ast.Attribute(node.func.value, SWAP_NAMES[name], ast.Load()) if isinstance(node.func, ast.Attribute)
                    else ast.Name(SWAP_NAMES[name], ast.Load()))
            return self._site(node, ast.Call(func, node.args, node.keywords), f"{name} -> {SWAP_NAMES[name]}")
        if name in REMOVABLE:  # f(x) -> x; x.f(...) -> x
            module_function = isinstance(node.func, ast.Name) or (
                isinstance(node.func.value, ast.Name) and node.func.value.id in ("torch", "html", "math", "np"))
            kept = (node.args[0] if node.args else None) if module_function else node.func.value
            if kept is not None:
                return self._site(node, kept, f"{name}(...) removed")
        return node


def mutants(file: str, target: str) -> list[tuple[int, str, str]]:
    """(index, description, mutated source) of every mutant of `target` in `file`."""
    source = (REPO / file).read_text()
    counter = Mutator(target)
    counter.visit(ast.parse(source))
    found = []
    for index in range(counter.count):
        mutator = Mutator(target, index)
        tree = ast.fix_missing_locations(mutator.visit(ast.parse(source)))
        found.append((index, mutator.description, ast.unparse(tree)))
    return found


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, float]:
    """(passed, seconds) of the tests in the copy."""
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "RLVER_CACHE": os.environ.get("RLVER_CACHE", str(REPO / "cache"))}
    try:
        finished = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
        passed = finished.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False
    return passed, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated target names (function or Class.method)")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once, each in its own copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--out", default="runs/mutation.json", help="results (one row per mutant)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    targets = [t for t in TARGETS if not only or t[1] in only]
    work = [(file, target, tests, index, description, source)
            for file, target, tests in targets for index, description, source in mutants(file, target)]
    if args.list:
        for file, target, _, index, description, _ in work:
            print(f"{file}:{target} #{index} {description}")
        print(f"{len(work)} mutants")
        return

    scratch = Path(tempfile.mkdtemp(prefix="mutation-"))
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    copies = []
    for worker in range(args.workers):
        copy = scratch / f"copy{worker}"
        for name in tracked:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
        copies.append(copy)
    baseline = {}
    for file, target, tests in targets:  # the unmutated code must pass, and sets each target's time limit
        passed, seconds = run_tests(copies[0], tests, timeout=900)
        if not passed:
            raise SystemExit(f"the tests of {target} fail on the unmutated code: {' '.join(tests)}")
        baseline[target] = seconds
        print(f"baseline {target}: {seconds:.0f} s", flush=True)

    free = list(copies)
    results = []

    def test_one(item):
        file, target, tests, index, description, source = item
        copy = free.pop()
        try:
            (copy / file).write_text(source)
            passed, seconds = run_tests(copy, tests, timeout=3 * baseline[target] + 30)
        finally:
            shutil.copy2(REPO / file, copy / file)
            free.append(copy)
        row = {"file": file, "target": target, "mutant": index, "change": description, "killed": not passed,
               "seconds": round(seconds, 1)}
        print(("killed  " if not passed else "SURVIVED") + f" {file}:{target} #{index} {description}", flush=True)
        return row

    started = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(test_one, work))
    shutil.rmtree(scratch, ignore_errors=True)
    killed = sum(r["killed"] for r in results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    print(f"\n{killed} of {len(results)} mutants killed ({100 * killed / max(1, len(results)):.1f}%) in "
          f"{(time.perf_counter() - started) / 60:.1f} min; rows in {args.out}")
    for row in results:
        if not row["killed"]:
            print(f"  survived: {row['file']}:{row['target']} #{row['mutant']} {row['change']}")


if __name__ == "__main__":
    main()
