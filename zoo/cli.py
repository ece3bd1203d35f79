"""The entry points of the zoo commands (pyproject's [project.scripts]): zoo-train, zoo-pretrain, zoo-sweep, zoo-plot.

Each answers `--version` and `--help` here, before torch or Hydra is imported, so both return at once; any
other command line goes to the command's module, `zoo.train.main(argv)` and so on, imported only then.

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


def dispatch(prog: str, module: str, argv: list[str] | None, usage: Callable[[], str] | None = None) -> None:
    """`--version`, or `--help` when `usage` is given, answered here; anything else runs `module.main(args)`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:
        print(version_line(prog))
        return
    if usage is not None and any(a in HELP_FLAGS for a in args):
        print(usage())
        return
    importlib.import_module(module).main(args)


def _train_usage() -> str:
    return module_usage("zoo.train") + "\n" + preset_lines(("model", "data", "optim", "logger", "experiment"))


def _pretrain_usage() -> str:
    return module_usage("zoo.pretrain") + "\n" + preset_lines(("model", "lm_data"))


def train(argv: list[str] | None = None) -> None:
    """zoo-train."""
    dispatch("zoo-train", "zoo.train", argv, _train_usage)


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
