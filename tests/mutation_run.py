"""Mutation testing of the functions where RL code goes silently wrong: are the tests sharp enough?

    python tests/mutation_run.py                 # every target; docs/testing.md has the figures
    python tests/mutation_run.py --only ppo_losses,masked_gae --workers 2
    python tests/mutation_run.py --list          # the mutants, without running anything
    python tests/mutation_run.py --everywhere --sample 240   # a seeded sample over every function of every file
    python tests/mutation_run.py --written set.jsonl --full  # bugs written by hand, against the whole suite

Each mutant is one small change in one target function, of the kinds that make RL code wrong without
crashing it: a comparison moved by one (`<` -> `<=`), an operator swapped (`+` -> `-`, `*` -> `/`), `max` ->
`min`, a sign dropped, a constant moved by one, `and` -> `or`, `True` -> `False`, a call's result replaced by
its first argument (an escape or a clamp removed), an option read in place of its pair (`clip_range` ->
`value_clip_range`, `gamma` -> `lam`), a call's first two arguments swapped. The mutated file is written into a scratch copy of the
repository, the unit tests of that file run there (`pytest -x`, TESTS_OF_FILE), and the mutant is killed if they
fail or time out.
A survivor is either a missing test or an equivalent mutant (one that cannot change behaviour): list it in
docs/testing.md with the reason.

--written takes bugs written by someone who has not read the tests, one JSON line each: {"id", "file", "old", "new"}
(`old` found exactly once in `file`, replaced by `new`). Each runs against the fast subset (`-m "not slow"`,
`-n 2`, stopping at the first failure); with --full, a survivor then meets the slow tests too, so that the
two figures are the fast subset's and the whole suite's.
"""
import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The unit tests of each file (not those marked slow; -k matches marker names too): every mutant of the file
# runs all of them, as a bug written by someone else would meet the whole suite, not tests chosen for it.
UNIT = ["-k", "not slow"]
TESTS_OF_FILE = {
    "train_ppo.py": ["tests/test_train_ppo.py", "tests/test_ppo_oracles.py", "tests/test_turn_credit.py"],
    "train_grpo.py": ["tests/test_train_grpo.py", "tests/test_grpo_oracles.py", "tests/test_turn_credit.py"],
    "rollout.py": ["tests/test_rollout.py", "tests/test_rollout_properties.py", "tests/test_turn_credit.py"],
    "generation.py": ["-k", "not slow or cached_prefix or prefills_every_call or half_of_the_new", "tests/test_rollout.py", "tests/test_rollout_properties.py",
                      "tests/test_generation_ends.py"],  # the prefix cache's tests load a tiny model
    "simulator.py": ["tests/test_llm_simulator.py", "tests/test_rule_simulator.py", "tests/test_simulator_properties.py"],
    "llm_user.py": ["tests/test_llm_simulator.py", "tests/test_analysis_format.py", "tests/test_simulator_properties.py"],
    "rule_user.py": ["tests/test_rule_simulator.py", "tests/test_simulator_properties.py"],
    "eval_sentient.py": ["tests/test_eval_sentient.py", "tests/test_eval_oracles.py"],
    "report.py": ["tests/test_report.py", "tests/test_eval_oracles.py"],
    "eval_general.py": ["tests/test_eval_general.py", "tests/test_eval_oracles.py"],
    "common.py": ["tests/test_common_oracles.py", "tests/test_input_checks.py", "tests/test_rollout_properties.py"],
}
# (file, function or Class.method): where RL code goes silently wrong.
TARGETS = [
    ("train_ppo.py", "ppo_losses"), ("train_ppo.py", "masked_gae"), ("train_ppo.py", "whiten"),
    ("train_ppo.py", "masked_mean"), ("train_ppo.py", "place_rewards"), ("train_ppo.py", "turn_rewards"),
    ("train_ppo.py", "dialogue_rows"), ("train_ppo.py", "state_values"), ("train_ppo.py", "minibatch_rows"),
    ("train_ppo.py", "value_metrics"),
    ("train_grpo.py", "turn_terms"), ("train_grpo.py", "token_advantages"),
    ("rollout.py", "Dialogue.turn_changes"), ("rollout.py", "Dialogue.token_turns"), ("rollout.py", "reward"),
    ("rollout.py", "dialogue_metrics"), ("rollout.py", "Dialogue.append"), ("rollout.py", "DialogueRunner._sample"),
    ("rollout.py", "DialogueRunner._cut_thought"), ("rollout.py", "DialogueRunner._read_turn"),
    ("guards.py", "drop_rows_from"), ("rollout.py", "check_failures"),
    ("generation.py", "split_think"), ("generation.py", "PrefixCache.reuse"),
    ("simulator.py", "Simulator.respond"), ("llm_user.py", "parse_analysis"),
    ("rule_user.py", "RuleUser.score"), ("rule_user.py", "RuleUser._worth"),
    ("eval_sentient.py", "summarize"), ("eval_sentient.py", "judged_replies"), ("eval_sentient.py", "bootstrap_interval"),
    ("eval_sentient.py", "group_figures"),
    ("report.py", "conversation"), ("report.py", "dialogue_block"), ("report.py", "filters"),
    ("report.py", "summary_figures"), ("report.py", "first_divergence"),
    ("eval_general.py", "network_namespace"), ("eval_general.py", "run_sandboxed"),
    ("common.py", "json_lines"), ("common.py", "repair_last_line"), ("guards.py", "check_options"),
]

SWAP_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
SWAP_BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
               ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv}
REMOVABLE = {"escape", "clamp", "clip", "abs", "exp", "detach", "strip", "round", "sqrt"}
SWAP_NAMES = {"max": "min", "min": "max", "any": "all", "all": "any", "amax": "amin", "amin": "amax"}
# Options that come in pairs: reading one where the other was meant passes every test that gives both the
# same value, so each is also mutated into its partner.
PAIRED_OPTIONS = [("clip_range", "value_clip_range"), ("gamma", "lam"), ("learning_rate", "critic_learning_rate"),
                  ("minibatch_size", "micro_batch_size"), ("profiles_per_step", "dialogues_per_profile"),
                  ("entropy_coef", "kl_coef"), ("max_steps", "save_steps"), ("max_think_tokens", "max_reply_tokens"),
                  ("lora_r", "lora_alpha"), ("temperature", "top_p"), ("success_threshold", "failure_threshold")]
NOT_SWAPPED = {"isinstance", "getattr", "hasattr", "setattr", "print", "warn",  # a swap there only crashes
               "max", "min", "maximum", "minimum"}  # or changes nothing
PARTNER = {a: b for pair in PAIRED_OPTIONS for a, b in (pair, pair[::-1])}


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

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if self.inside and isinstance(node.ctx, ast.Load) and node.attr in PARTNER:
            mutated = ast.Attribute(node.value, PARTNER[node.attr], ast.Load())
            return self._site(node, mutated, f".{node.attr} -> .{PARTNER[node.attr]}")
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if not self.inside:
            return node
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if (len(node.args) >= 2 and name not in NOT_SWAPPED
                and not any(isinstance(a, ast.Starred) for a in node.args[:2])):
            swapped = ast.Call(node.func, [node.args[1], node.args[0], *node.args[2:]], node.keywords)
            node = self._site(node, swapped, f"{ast.unparse(node.func)}(...): first two arguments swapped")
            if node is swapped:
                return node
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


def site_count(file: str, target: str) -> int:
    counter = Mutator(target)
    counter.visit(ast.parse((REPO / file).read_text()))
    return counter.count


def mutants(file: str, target: str, indices=None) -> list[tuple[int, str, str]]:
    """(index, description, mutated source) of the mutants of `target` in `file`: all, or those at `indices`."""
    source = (REPO / file).read_text()
    found = []
    for index in range(site_count(file, target)) if indices is None else indices:
        mutator = Mutator(target, index)
        tree = ast.fix_missing_locations(mutator.visit(ast.parse(source)))
        found.append((index, mutator.description, ast.unparse(tree)))
    return found


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, float]:
    """(passed, seconds) of the tests in the copy."""
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "RLVER_CACHE": os.environ.get("RLVER_CACHE") or str(REPO / "cache")}
    for name in ("RLVER_OFFICIAL_REPO", "RLVER_OFFICIAL_DATA"):  # the copy runs in another folder: a relative
        if env.get(name):  # path would miss there, and the tests that need it would be skipped without a word
            env[name] = os.path.abspath(env[name])
    try:
        finished = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=copy, capture_output=True, text=True, timeout=timeout, env=env)
        passed = finished.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False
    return passed, time.perf_counter() - started


def copy_of_repository(folder: Path) -> Path:
    """The tracked files and the untracked ones git does not ignore, copied into `folder`."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    return folder


def run_written(path: str, full: bool, out: str) -> None:
    """Each written mutant against the fast subset, then (full) a survivor against the slow tests."""
    mutants = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for mutant in mutants:
        found = (REPO / mutant["file"]).read_text().count(mutant["old"])
        if found != 1:
            raise SystemExit(f"{mutant['id']}: its old text is found {found} times in {mutant['file']}, not once")
    scratch = Path(tempfile.mkdtemp(prefix="written-"))
    copy = copy_of_repository(scratch / "copy")
    stages = [("fast", ["-n", "2", "-m", "not slow"])] + ([("slow", ["-n", "2", "-m", "slow"])] if full else [])
    killed = {"fast": 0, "slow": 0}
    started = time.perf_counter()
    try:
        for mutant in mutants:
            original = (REPO / mutant["file"]).read_text()
            (copy / mutant["file"]).write_text(original.replace(mutant["old"], mutant["new"]))
            row = {"id": mutant["id"], "file": mutant["file"]}
            try:
                for name, selection in stages:
                    passed, seconds = run_tests(copy, selection, timeout=1800)
                    row[name] = {"killed": not passed, "seconds": round(seconds, 1)}
                    if not passed:
                        break
            finally:
                (copy / mutant["file"]).write_text(original)
            first_kill = next((name for name, _ in stages if row.get(name, {}).get("killed")), None)
            killed["fast"] += first_kill == "fast"
            killed["slow"] += first_kill is not None  # the whole suite: what the fast subset or the slow tests kill
            print(f"{'killed by ' + first_kill if first_kill else 'SURVIVED':16} {mutant['id']} {mutant['file']}: "
                  f"{mutant.get('why', '')}", flush=True)
            with open(out, "a", encoding="utf-8") as rows:
                rows.write(json.dumps(row) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    minutes = (time.perf_counter() - started) / 60
    print(f"\nfast subset: {killed['fast']} of {len(mutants)} killed ({100 * killed['fast'] / len(mutants):.1f}%)"
          + (f"; whole suite: {killed['slow']} ({100 * killed['slow'] / len(mutants):.1f}%)" if full else "")
          + f"; {minutes:.1f} min; rows in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated target names (function or Class.method)")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once, each in its own copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--everywhere", action="store_true",
                        help="every function of every file with unit tests, not only TARGETS (* as the target)")
    parser.add_argument("--sample", type=int, default=0, help="test this many mutants drawn at random (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument("--out", default="runs/mutation.json",
                        help="results, one JSON line per mutant as it finishes (a new file)")
    parser.add_argument("--written", help="a JSON-lines file of mutants written by hand (see above)")
    parser.add_argument("--full", action="store_true", help="with --written: survivors of the fast subset meet "
                                                            "the slow tests too")
    args = parser.parse_args()
    if Path(args.out).exists():
        parser.error(f"--out {args.out} exists: choose a new file (results are never overwritten)")
    if args.written:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        return run_written(args.written, args.full, args.out)
    only = set(filter(None, args.only.split(",")))
    chosen = [(file, "*") for file in TESTS_OF_FILE] if args.everywhere else TARGETS
    targets = [(file, target, [*UNIT, *TESTS_OF_FILE[file]]) for file, target in chosen
               if not only or target in only or file in only]
    sites = [(file, target, tests, index) for file, target, tests in targets
             for index in range(site_count(file, target))]
    if args.sample:
        sites = sorted(random.Random(args.seed).sample(sites, min(args.sample, len(sites))), key=sites.index)
    work = [(file, target, tests, index, description, source)
            for file, target, tests in targets
            for index, description, source in mutants(file, target, [i for f, t, _, i in sites if (f, t) == (file, target)])]
    if args.list:
        for file, target, _, index, description, _ in work:
            print(f"{file}:{target} #{index} {description}")
        print(f"{len(work)} mutants")
        return

    scratch = Path(tempfile.mkdtemp(prefix="mutation-"))
    copies = [copy_of_repository(scratch / f"copy{worker}") for worker in range(args.workers)]
    baseline = {}
    targets = [(file, target, tests) for file, target, tests in targets if any(w[:2] == (file, target) for w in work)]
    for file, target, tests in targets:  # the unmutated code must pass, and sets each target's time limit
        passed, seconds = run_tests(copies[0], tests, timeout=900)
        if not passed:
            raise SystemExit(f"the tests of {target} fail on the unmutated code: {' '.join(tests)}")
        baseline[file, target] = seconds
        print(f"baseline {file}:{target}: {seconds:.0f} s", flush=True)

    free = list(copies)
    results = []

    def test_one(item):
        file, target, tests, index, description, source = item
        copy = free.pop()
        try:
            (copy / file).write_text(source)
            passed, seconds = run_tests(copy, tests, timeout=3 * baseline[file, target] + 30)
        finally:
            shutil.copy2(REPO / file, copy / file)
            free.append(copy)
        row = {"file": file, "target": target, "mutant": index, "change": description, "killed": not passed,
               "seconds": round(seconds, 1)}
        print(("killed  " if not passed else "SURVIVED") + f" {file}:{target} #{index} {description}", flush=True)
        with written, open(args.out, "a", encoding="utf-8") as out:  # as each finishes: a run stopped after
            out.write(json.dumps(row) + "\n")  # hours keeps what it measured
        return row

    started, written = time.perf_counter(), threading.Lock()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(test_one, work))
    except KeyboardInterrupt:  # the mutants' pytest runs got the Ctrl-C too
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"\ninterrupted: the finished mutants' rows are in {args.out}", file=sys.stderr)
        raise SystemExit(130) from None
    shutil.rmtree(scratch, ignore_errors=True)
    killed = sum(r["killed"] for r in results)
    print(f"\n{killed} of {len(results)} mutants killed ({100 * killed / max(1, len(results)):.1f}%) in "
          f"{(time.perf_counter() - started) / 60:.1f} min; rows in {args.out}")
    for row in results:
        if not row["killed"]:
            print(f"  survived: {row['file']}:{row['target']} #{row['mutant']} {row['change']}")


if __name__ == "__main__":
    main()
