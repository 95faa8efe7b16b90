"""The first hour at the command line: `--help` of every subcommand imports no jax (it answers
in a second, not in the 29 s jax's import took), and every flag says what it does and its
default."""
import argparse
import subprocess
import sys

import pytest

from hetero_jax import cli
from hetero_jax.bench import config as bench_config
from hetero_jax.bench import online
from hetero_jax.offline import cli as offline_cli
from hetero_jax.server import cli as server_cli
from hetero_jax.sim import cli as sim_cli
from hetero_jax.sim.options import DefaultsHelpFormatter
from hetero_jax.train import cli as train_cli

SUBCOMMANDS = ["generate", "embed", "sim", "bench", "batch", "train-adapter", "serve",
               "bench-serve"]


def _subparsers(parser: argparse.ArgumentParser) -> list:
    """(prog, parser) for `parser` and every subparser that has its own flags."""
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(p.prog, p) for p in action.choices.values() if p.add_help]
    return found


PARSERS = (_subparsers(cli.build_parser()) + [
    ("sim", sim_cli.build_parser()), ("bench", bench_config.build_parser()),
    ("batch", offline_cli.build_parser()), ("train-adapter", train_cli.build_parser()),
    ("serve", server_cli.build_parser()), ("bench-serve", online.build_parser())])


def _undocumented(parser: argparse.ArgumentParser) -> list:
    """Flags of `parser` without help text, or whose help as printed names no default
    (switches, off unless given, and positionals excepted)."""
    formatter = parser._get_formatter()
    bad = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(a.option_strings) or a.dest
        if not a.help or a.help == argparse.SUPPRESS:
            bad.append(f"{name}: no help")
        elif a.option_strings and a.nargs != 0 and "default" not in formatter._expand_help(a):
            bad.append(f"{name}: no default shown")
    return bad


@pytest.mark.parametrize("prog,parser", PARSERS, ids=[p for p, _ in PARSERS])
def test_every_flag_has_help_and_a_default(prog, parser):
    assert not _undocumented(parser), f"{prog}: {_undocumented(parser)}"


def test_the_walk_sees_every_subcommand():
    progs = " ".join(p for p, _ in PARSERS)
    assert all(c in progs for c in SUBCOMMANDS), f"{progs=} misses one of {SUBCOMMANDS}"


def test_undocumented_flags_are_found():
    p = argparse.ArgumentParser()
    p.add_argument("--a", default=3, help="a number")
    p.add_argument("--b", default=3)
    p.add_argument("--c", default=3, help="shown (default: %(default)s)")
    p.add_argument("--d", action="store_true", help="a switch")
    assert _undocumented(p) == ["--a: no default shown", "--b: no help"]
    p.formatter_class = DefaultsHelpFormatter
    assert _undocumented(p) == ["--b: no help"]
    assert "a number (default: 3)" in p.format_help(), p.format_help()


HELP_SCRIPT = """
import sys
from hetero_jax.cli import main
for command in sys.argv[1:]:
    try:
        main([command, "--help"])
    except SystemExit as e:
        assert e.code == 0, f"{command} --help exited {e.code}"
print(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax"))))
"""


def test_help_imports_no_jax():
    """Every subcommand's --help in one fresh interpreter: afterwards no jax, jaxlib or flax
    module is loaded."""
    out = subprocess.run([sys.executable, "-c", HELP_SCRIPT, *SUBCOMMANDS], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{out.stderr[-2000:]}"
    assert out.stdout.strip().splitlines()[-1] == "[]", f"{out.stdout.splitlines()[-1]}"
