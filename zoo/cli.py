"""The entry points of the zoo commands (pyproject's [project.scripts]): zoo-train, zoo-pretrain, zoo-sweep, zoo-plot.

Each answers `--version` and `--help` here, before torch or Hydra is imported, so both return at once; any
other command line goes to the command's code, imported only then: `run_train` here for zoo-train (one run, or a
Hydra multirun whose jobs are `zoo.jobs.run_one`), `zoo.pretrain.main(argv)` and so on. The training code
(zoo.train) and the sweep (zoo.sweep) therefore never import each other's entry points.

The help texts live beside each command's code: the Hydra commands' `USAGE` strings are read from their
modules' source without importing them (`module_usage`), and the argparse commands (zoo-sweep, zoo-plot),
whose modules import nothing heavy, print their parser's own help. The cartridges commands use the same
helpers (cartridges/cli.py).

    python -m zoo.cli zoo-train --help        # the same as `zoo-train --help`, without an installed script
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from zoo import __version__

HELP_FLAGS = ("-h", "--help")
# zoo-train's exit status for a run stopped at train.stop_at or by SIGTERM, checkpointed (EX_TEMPFAIL: a job
# scheduler may requeue it, and train.resume=true continues it)
INTERRUPTED_EXIT = 75


def module_usage(module: str, name: str = "USAGE") -> str:
    """The string constant `name` of `module`, read from its source file without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"no module {module}")
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{module} defines no string {name}")


def preset_lines(groups: Sequence[str]) -> str:
    """One line per preset group: the YAML presets found under the config dir (zoo.paths.config_dir)."""
    from zoo.paths import config_dir

    root = config_dir()
    lines = []
    for group in groups:
        names = sorted(p.stem for p in (root / group).glob("*.yaml"))
        if names:
            lines.append(f"  {group}: {', '.join(names)}")
    return "Known presets:\n" + "\n".join(lines) if lines else ""


def version_line(prog: str) -> str:
    return f"{prog} (zoo {__version__})"


def dispatch(
    prog: str, run: str | Callable[[list[str]], None], argv: list[str] | None, usage: Callable[[], str] | None = None
) -> None:
    """`--version`, or `--help` when `usage` is given, answered here; anything else runs `run(args)`, or
    `run.main(args)` when `run` names a module."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:
        print(version_line(prog))
        return
    if usage is not None and any(a in HELP_FLAGS for a in args):
        print(usage())
        return
    (importlib.import_module(run).main if isinstance(run, str) else run)(args)


def _train_usage() -> str:
    return module_usage("zoo.train") + "\n" + preset_lines(("model", "data", "optim", "logger", "experiment"))


def _pretrain_usage() -> str:
    return module_usage("zoo.pretrain") + "\n" + preset_lines(("model", "lm_data"))


def multirun_job(overrides: list[str], job_num: int) -> dict:
    """One job of a Hydra multirun: `zoo.jobs.run_one` on its overrides (skip if finished, resume if started,
    failures recorded), on GPU `job_num mod count` when there are GPUs and no train.device override."""
    import torch

    from zoo.jobs import run_one

    extra = []
    if not any(o.startswith("train.device=") for o in overrides) and torch.cuda.is_available():
        extra.append(f"train.device=cuda:{job_num % torch.cuda.device_count()}")
    record = run_one(list(overrides), extra)
    print(
        f"zoo-train -m: job {job_num} {record['status']}: {record.get('run_dir') or ' '.join(overrides)}"
        + (f" ({record['error']})" if record.get("error") else ""),
        flush=True,
    )
    return record


def multirun(args: list[str]) -> None:
    """`zoo-train -m ...`: hand the command line to Hydra, whose sweeper and launcher run `multirun_job`."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from zoo.config import mixer_overrides, register_configs
    from zoo.gpus import MPS
    from zoo.paths import config_dir

    register_configs()
    print(f"zoo-train -m: {MPS.multirun_reason()}", file=sys.stderr, flush=True)

    @hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")
    def task(_node) -> dict:
        job = HydraConfig.get().job
        return multirun_job(list(HydraConfig.get().overrides.task), job.num)

    saved = sys.argv
    sys.argv = ["zoo-train", *mixer_overrides(args)[0]]  # Hydra composes each job too: options add or set
    try:
        task()
    finally:
        sys.argv = saved


def run_train(args: list[str]) -> None:
    """zoo-train's work: `-m` goes to Hydra (`multirun`); otherwise one run (or one lr pack), its summary printed;
    a bad config exits 2 with the one-line reason."""
    if "-m" in args or "--multirun" in args:
        multirun(args)
        return
    import logging

    from zoo.config import ConfigError
    from zoo.device import set_threads
    from zoo.train import Interrupted, load_config, train, train_runs

    show = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        cfg, resolved = load_config(args)
        if show:
            print(resolved, end="")
            return
        set_threads(cfg.train.threads)
        if cfg.train.pack_lrs or cfg.train.pack_seeds:
            from zoo.steps import pack_members

            summaries = train_runs(pack_members(cfg))
        else:
            summaries = [train(cfg, resolved)]
    except ConfigError as e:
        print(f"zoo-train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Interrupted as e:
        print(f"zoo-train: {e}; checkpointed: add train.resume=true to continue", file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT) from None
    keys = ["lr", "valid/accuracy", "test/accuracy", "state_bytes_fp32", "parameters", "wall_time_s"]
    for summary in summaries:
        print(" ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}" for k in keys))


def train(argv: list[str] | None = None) -> None:
    """zoo-train."""
    dispatch("zoo-train", run_train, argv, _train_usage)


def pretrain(argv: list[str] | None = None) -> None:
    """zoo-pretrain."""
    dispatch("zoo-pretrain", "zoo.pretrain", argv, _pretrain_usage)


def sweep(argv: list[str] | None = None) -> None:
    """zoo-sweep (argparse's help: zoo.sweep imports nothing heavy)."""
    dispatch("zoo-sweep", "zoo.sweep", argv)


def plot(argv: list[str] | None = None) -> None:
    """zoo-plot (argparse's help: zoo.plot imports matplotlib only to draw)."""
    dispatch("zoo-plot", "zoo.plot", argv)


COMMANDS: dict[str, Callable[[list[str] | None], None]] = {
    "zoo-train": train,
    "zoo-pretrain": pretrain,
    "zoo-sweep": sweep,
    "zoo-plot": plot,
}


def main(argv: list[str] | None = None) -> None:
    """`python -m zoo.cli COMMAND [ARGS]`: any zoo command, without its installed script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        print(f"usage: python -m zoo.cli {{{','.join(COMMANDS)}}} [ARGS ...]  (zoo {__version__})", file=sys.stderr)
        raise SystemExit(2)
    COMMANDS[args[0]](args[1:])


if __name__ == "__main__":
    main()
