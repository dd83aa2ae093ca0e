"""The `moeswarm` command: a thin table of subcommands over the library.

Each subcommand lives in `moeswarm/commands/<name>.py` (bench and wan: in the moeswarm-bench
distribution's `moeswarm_bench/commands/`, when it is installed) and exposes `add_arguments(parser)` and
`run(args) -> int`: its flags, then one call into the library. Only the chosen command's module is
imported (its flags are only needed then), and a command imports the library modules that load
torch inside `run` (the one import there), not at its top: `moeswarm --help` and `moeswarm COMMAND
--help` load no torch, and one command's heavy imports never slow another.

A user's mistake (a bad flag, a missing file, a busy port) ends in one line on stderr and exit
status 2; a traceback means a bug (`moeswarm --debug COMMAND ...` shows one for any error).
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: backbone and workers often share a machine (a
# demo, a test, a small swarm), and spinning threads of one process steal the cores another is
# waiting for (docs/measured.md, "threads"). Must be
# set before torch loads; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import importlib  # noqa: E402
import sys  # noqa: E402

from moeswarm import __version__  # noqa: E402

COMMANDS: dict[str, str] = {
    "demo": "run a generation on the bundled model with local workers and report the accounting",
    "worker": "serve a slice of a model's routed experts over TCP",
    "stage": "serve a span of a model's decoder layers to gateways (an island: its own workers, one WAN trip per stage)",
    "generate": "generate text with a backbone whose experts live on remote workers",
    "serve": "an OpenAI-compatible HTTP gateway: concurrent requests share every MoE round trip",
    "gate": "argmax/cosine gate of a wire configuration (combine mode, codecs) against exact local",
    "bench": "benchmarks: loopback overhead, PING under load, backbone memory, bytes on the wire, WAN",
    "make-model": "write a small random MoE model of a given family (for tests and trials)",
    "slice": "cut a GGUF slice file holding some experts of a GGUF model (for workers)",
    "wan": "emulate a WAN link: a TCP proxy with latency, jitter, bandwidth and faults",
    "info": "describe a model: family, layers, experts, sizes, tensor types, and an --experts split",
    "keygen": "make a swarm key: mutual TLS between the backbones and workers that hold it",
    "ping": "ask running workers what they serve (model, layers, experts) and time their PING round trip",
    "relay": "splice backbones to workers that cannot be dialled (behind NAT); TLS stays end to end",
    "profile": "count a model's routing over calibration prompts: a profile for --local-experts",
    "plan": "place experts on workers by capacity and RTT from a routing profile: hot near, co-selected together",
    "dht": "a standing DHT node where workers announce themselves and backbones find them (--swarm)",
    "manifest": "hash a GGUF model's pieces: the manifest its owner publishes for fetch-slice",
    "seed": "serve byte ranges of a model file to workers fetching their slice (fetch-slice)",
    "invite": "start a swarm's first member (DHT node, seeders of the model and its manifest) and print its invite",
    "join": "join a swarm from its invite: take a share where it is weakest, fetch just those bytes, serve them",
    "status": "show a swarm from its invite: members, their shares, coverage per layer with the weakest marked",
    "fetch-slice": "fetch just some experts' bytes from a seeder, checked against the owner's manifest, into a slice file",
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows each flag's default, unless its help already speaks of one or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        hidden = hidden or not action.option_strings
        if hidden or "default" in help_text or isinstance(action, argparse._StoreConstAction):
            return help_text
        return f"{help_text} (default: %(default)s)" if help_text else "(default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """An argument mistake is one line naming it and where help is, not the whole usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the flags of the command named in `argv` (if any) filled in."""
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = ArgumentParser(prog="moeswarm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"moeswarm {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the full traceback instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, help_text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = _command_module(name)
            module.add_arguments(command_parser)
            command_parser.set_defaults(_module=module)
    return parser


# Commands of the moeswarm-bench distribution (bench/ in the repository: moeswarm_bench/commands/), outside
# the library: loaded by name when it is installed. This is the one place the library names it.
TOOL_COMMANDS = ("bench", "wan")
TOOLS_PACKAGE = "moeswarm_bench"
TOOLS_MISSING = ("moeswarm {name}: error: needs the moeswarm-bench distribution, which is not installed "
                 "(in a checkout of moeswarm: python -m pip install -e bench/)")


def _command_module(name: str):
    if name not in TOOL_COMMANDS:
        return importlib.import_module(f"moeswarm.commands.{name.replace('-', '_')}")
    try:
        return importlib.import_module(f"{TOOLS_PACKAGE}.commands.{name}")
    except ModuleNotFoundError as error:
        if error.name != TOOLS_PACKAGE:  # installed, and something it needs is missing: a bug, a traceback
            raise
        print(TOOLS_MISSING.format(name=name), file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return status
    except BrokenPipeError:  # `moeswarm info M | head`: the reader is gone, so is the rest of the output
        _silence_stdout()
        return 141  # as a shell reports a command ended by SIGPIPE


def _main(argv: list[str]) -> int:
    from moeswarm.commands._setup import quiet_transformers

    quiet_transformers()  # before the parser: a command's module may load transformers, which reads it once
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # one clear line for the user's mistakes; anything else is a bug: a traceback
        from moeswarm.errors import MoeSwarmError, one_line

        if args.debug or not isinstance(error, MoeSwarmError):
            raise
        print(f"moeswarm {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2
    finally:
        from moeswarm.gc_freeze import thaw

        thaw()  # what the command froze once loaded (gc_freeze.py) is the collector's again


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail on the closed pipe too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
