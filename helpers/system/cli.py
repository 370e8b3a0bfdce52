"""The command line's frame. A command is a `Command`: its name, one line of help, a function that adds its
arguments and one that runs it, defined in the module of what it drives (`helpers.measure.flops` defines `flops`);
`python -m helpers` lists them in `COMMANDS`. The options several commands share, and the defaults that depend on
the scale, are defined here once. Building the parser imports no benchmark library: a command imports what it
runs inside `run`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

from .args import positive_int

SCALES = ("smoke", "cpu", "gpu")
DEVICES = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class Command:
    """name: as typed after `python -m helpers`; arguments(parser) adds its options; run(args) returns the exit
    code. scale_defaults: per scale, the values of options left out (shown by --help, set by `fill_scale_defaults`).
    """

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    scale_defaults: dict[str, dict[str, object]] = field(default_factory=dict)


def add_device(parser: argparse.ArgumentParser, default: str = "the best available") -> None:
    parser.add_argument("--device", choices=DEVICES, help=f"default: {default}")


def add_json(parser: argparse.ArgumentParser, instead_of: str = "text", shape: str = "one JSON object") -> None:
    parser.add_argument("--json", action="store_true", help=f"{shape} instead of {instead_of}")


def add_scaled(parser: argparse.ArgumentParser, command: Command, dest: str, what: str, **kwargs) -> None:
    """An option whose default depends on the scale: `--dest` (underscores as dashes), its help listing the
    default at each scale from `command.scale_defaults`. kwargs: as `add_argument` (type positive_int unless
    given)."""
    values = ", ".join(f"{scale} {command.scale_defaults[scale][dest]}" for scale in SCALES)
    kwargs.setdefault("type", positive_int)
    parser.add_argument("--" + dest.replace("_", "-"), help=f"{what} (default by scale: {values})", **kwargs)


def fill_scale_defaults(args: argparse.Namespace, command: Command) -> str:
    """Set every option of `command` left out to its default at this device's scale; returns the device."""
    from .device import default_device_type
    from .scale import current_scale

    device = args.device or default_device_type()
    for dest, value in command.scale_defaults[current_scale(device)].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return device


def build_parser(commands: list[Command], description: str) -> argparse.ArgumentParser:
    """One subcommand per Command; each parsed Namespace carries its command (`args.command`) and its parser
    (`args.command_parser`, for usage errors found after parsing)."""
    parser = CommandParser([command.name for command in commands], prog="python -m helpers", description=description)
    subparsers = parser.add_subparsers(dest="name", metavar="COMMAND", title="commands",
                                       parser_class=argparse.ArgumentParser)
    for command in commands:
        sub = subparsers.add_parser(command.name, help=command.help)
        command.arguments(sub)
        sub.set_defaults(command=command, command_parser=sub)
    return parser


class CommandParser(argparse.ArgumentParser):
    """A parser whose command is required, and which says which commands exist when none is given (argparse's own
    message names only the argument's internal name)."""

    def __init__(self, command_names: list[str], **kwargs):
        super().__init__(**kwargs)
        self.command_names = command_names

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.name is None:
            self.error(f"a command is required, one of: {', '.join(self.command_names)} "
                       "(python -m helpers COMMAND --help for one)")
        return parsed
