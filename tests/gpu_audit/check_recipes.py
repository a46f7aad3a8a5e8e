"""The recipes parsed exactly as the scripts parse them, the accelerate configs loaded, whether trackio (the
recipes' report_to) is importable or pinned, and accelerate's check on several models prepared under DeepSpeed:
first on two bare modules (accelerate's own rule, which always refuses), then on what train_ppo.py prepares (its
policy and critic as one module, one optimizer)."""
import glob
import os
import sys

OUT = os.environ["AUDIT_OUT"]  # the scratch folder run_all.sh made
REPO = os.path.join(OUT, "repo")  # the copy of the project
sys.path.insert(0, REPO)
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.commands.config.config_args import load_config_from_file  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from trl import GRPOConfig, ModelConfig, TrlParser  # noqa: E402
import preflight, rollout, simulator, train_grpo, train_ppo  # noqa: E402,E401
for recipe in sorted(glob.glob(os.path.join(REPO, "recipes", "grpo_*.yaml"))):
    parser = TrlParser((rollout.DialogueArguments, simulator.SimulatorArguments, GRPOConfig, ModelConfig))
    parser.set_defaults(**train_grpo.DEMO_DEFAULTS)  # as train_grpo.main() does
    d, s, t, m = parser.parse_args_and_config(["--config", recipe, "--bf16", "false"])
    print(os.path.basename(recipe), "| save_strategy", t.save_strategy.value, "(save_steps", t.save_steps, ") | report_to", t.report_to,
          "| IS mode", t.vllm_importance_sampling_mode, "clip_max", t.vllm_importance_sampling_clip_max)
for recipe in sorted(glob.glob(os.path.join(REPO, "recipes", "ppo_*.yaml"))):
    a, d, s = train_ppo.parse_arguments(["--config", recipe])
    print(os.path.basename(recipe), "| use_peft", a.use_peft, "| report_to", a.report_to)
for path in sorted(glob.glob(os.path.join(REPO, "accelerate_configs", "*.yaml"))):
    cfg = load_config_from_file(path)
    print(os.path.basename(path), "| loads:", cfg.distributed_type, cfg.num_processes, cfg.deepspeed_config or "")
try:
    import trackio  # noqa: F401
    print("trackio installed")
except ImportError:
    pinned = [line for line in open(os.path.join(REPO, "requirements-gpu.txt")) if line.startswith("trackio==")]
    print("trackio: not installed here;", f"pinned in requirements-gpu.txt ({pinned[0].split()[0]})" if pinned
          else "NOT in requirements-gpu.txt", "| train_grpo refuses it missing:",
          preflight.missing_trackers(["trackio"]))
acc = Accelerator()
acc.state.distributed_type = DistributedType.DEEPSPEED  # what zero2.yaml selects
p, c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
try:
    acc.prepare(p, c, torch.optim.AdamW(p.parameters()), torch.optim.AdamW(c.parameters()))
except AssertionError as e:
    print("two models under DeepSpeed (accelerate's rule) ->", type(e).__name__, e)
networks = train_ppo.PolicyAndCritic(p, c)
try:
    acc.prepare(networks, torch.optim.AdamW(networks.parameters()))
    print("train_ppo.py's PolicyAndCritic under DeepSpeed: prepared")
except AssertionError as e:
    print("train_ppo.py's PolicyAndCritic under DeepSpeed ->", type(e).__name__, e)
except Exception as e:  # noqa: BLE001  past accelerate's one-model check; this bare state has no DeepSpeed plugin
    print(f"train_ppo.py's PolicyAndCritic under DeepSpeed: passes accelerate's one-model check (then "
          f"{type(e).__name__}, this fake state has no DeepSpeed plugin; tests/test_ppo_gpu_paths.py runs real ZeRO-2)")
