"""Entry points of cartridges-synthesize, cartridges-distill and cartridges-eval (pyproject's [project.scripts]).

As in zoo/cli.py: `--version` and `--help` answer before torch is imported (the help is each module's USAGE,
read from its source); anything else runs the module's `main(argv)`. cartridges-serve's options are
built by cartridges/serve_args.py (argparse alone), so its `--help` and `--version` skip the server too.
"""

from __future__ import annotations

from zoo.cli import dispatch, module_usage


def synthesize(argv: list[str] | None = None) -> None:
    """cartridges-synthesize."""
    dispatch("cartridges-synthesize", "cartridges.self_study", argv, lambda: module_usage("cartridges.self_study"))


def distill(argv: list[str] | None = None) -> None:
    """cartridges-distill."""
    dispatch("cartridges-distill", "cartridges.distill", argv, lambda: module_usage("cartridges.distill"))


def evaluate(argv: list[str] | None = None) -> None:
    """cartridges-eval."""
    dispatch("cartridges-eval", "cartridges.eval", argv, lambda: module_usage("cartridges.eval"))


def serve(argv: list[str] | None = None) -> None:
    """cartridges-serve."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "--version") for a in args):
        from cartridges.serve_args import serve_parser

        serve_parser().parse_args(args)  # prints the help or the version and exits
        return
    from cartridges.http import main

    main(args)
