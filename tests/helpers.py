"""Helpers the test modules share (no test module imports another)."""

import json
import subprocess
import sys

from isojax.core.penalties import PENALTIES


def arm(method: str) -> dict:
    """The config fields of a study-style arm label: "isobn" -> normalizer isobn, "istar" ->
    penalty istar, "isobn+istar" -> both (as `experiments/configs/study_recipe.arm_fields`)."""
    fields = {"normalizer": "none", "penalty": "none"}
    for part in method.split("+"):
        if part != "none":
            fields["penalty" if part in PENALTIES else "normalizer"] = part
    return fields


# `isojax finetune` in a child process, with faults injected from inside (the audit's probes):
# CHILD_HOOKS (JSON) names them; the rest of argv is the command's.
#   signal_after_step [step, "SIGTERM"]   from the log hook, right after that training step
#   exit_after_step   step                os._exit(137) there (what a SIGKILL leaves)
#   signal_in_eval    "SIGINT"            during the first dev evaluation of this process
#   signal_in_c0      "SIGTERM"           during the first C0 pass of this process
#   signal_in_save    [step, "SIGTERM"]   while the first save of that step in checkpoints/ runs
#   signal_in_setup   "SIGTERM"           at the start of the build (data, model)
#   rank              "1"                 only the process of that JAX_PROCESS_ID is hooked
CHILD = """
import json, os, signal, sys
from isojax import cli
from isojax.training import checkpointing, evaluation, loop, reporting

hooks = json.loads(os.environ.get("CHILD_HOOKS", "{}"))
def send(name):
    os.kill(os.getpid(), getattr(signal, name))
def once(hook):
    def wrapper(*args, **kwargs):
        if not wrapper.done:
            wrapper.done = True
            send(hook)
        return wrapper.call(*args, **kwargs)
    wrapper.done = False
    return wrapper
if os.environ.get("JAX_PROCESS_ID", "0") == hooks.get("rank", "0"):
    log_train = reporting.RunLog.train
    def train(self, step, epoch, pop_means):
        log_train(self, step, epoch, pop_means)
        if step == hooks.get("signal_after_step", [None])[0]:
            send(hooks["signal_after_step"][1])
        if step == hooks.get("exit_after_step"):
            os._exit(137)
    reporting.RunLog.train = train
    for name, module, attr in (("signal_in_eval", evaluation, "evaluate_all"),
                               ("signal_in_c0", loop, "c0_pass"),
                               ("signal_in_setup", loop, "setup")):
        if name in hooks:
            wrapped = once(hooks[name])
            wrapped.call = getattr(module, attr)
            setattr(module, attr, wrapped)
    if "signal_in_save" in hooks:
        save, (at, name) = checkpointing.Checkpointer.save, hooks["signal_in_save"]
        def signal_in_save(self, step, *args, **kwargs):
            if step == at and self.directory.name == "checkpoints" and not signal_in_save.done:
                signal_in_save.done = True
                send(name)
            save(self, step, *args, **kwargs)
        signal_in_save.done = False
        checkpointing.Checkpointer.save = signal_in_save
sys.exit(cli.main(sys.argv[1:]))
"""


def finetune_argv(workdir, glue_dir, tokenizer, *sets: str, normalizer: str = "isobn") -> list:
    """`isojax finetune` on tiny-bert over `sets` (`key=value`) on top of the small RTE run of
    the preemption tests: 48 rows, batches of 8 (6 steps an epoch), 2 epochs, no dropout."""
    base = (
        f"tokenizer={tokenizer}", "max_train_examples=48", "max_eval_examples=8",
        "batch_size=8", "eval_batch_size=8", "max_length=32", "buckets=()", "num_epochs=2",
        "log_every=1", "progress=False", "tensorboard=False", "dropout_rate=0.0",
        "optimizer.learning_rate=1e-3",
    )  # fmt: skip
    argv = ["finetune", "--task", "rte", "--normalizer", normalizer, "--model", "tiny-bert"]
    argv += ["--data-dir", str(glue_dir), "--workdir", str(workdir)]
    for item in (*base, *sets):
        argv += ["--set", item]
    return argv


def start_child(tmp_path, argv: list, hooks: dict | None = None, **env) -> subprocess.Popen:
    """`CHILD` (written into `tmp_path`) running `isojax` with `argv` and the fault `hooks`,
    one CPU device unless `env` says otherwise (`children.child_env`), a compilation cache
    shared by the test's children; stdout and stderr piped (`children.finish` waits)."""
    from children import child_env

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {"devices": 1, **env}
    devices = env.pop("devices")
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, argv)],
        env=child_env(
            devices=devices,
            cache=tmp_path / f"jax-cache-{devices}",
            CHILD_HOOKS=json.dumps(hooks or {}),
            **env,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def dev_lines(workdir) -> list[tuple[int, int]]:
    """`(step, epoch)` of each dev line of a run folder's `metrics.jsonl`."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["epoch"]) for row in rows if row["split"] != "train"]
