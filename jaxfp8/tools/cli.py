"""The command line, `python -m jaxfp8 [COMMAND] [--flag=value ...]`.

Each command is a module that defines its flags (absl) on a FlagValues of its own and a `main(command_line) -> exit
status`; only the command that runs is imported, and `python -m jaxfp8 COMMAND --help` prints that command's flags.
A command that cannot run (a flag that does not parse, no GPU, an optional dependency missing) prints one line on
stderr and exits non-zero (2 for a usage error, 1 otherwise), without a traceback.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Sequence

from absl import flags

from jaxfp8.tools import args

PROG = "python -m jaxfp8"
COMMANDS = {
    "check": ("jaxfp8.tools.check", "(the default) the quantizer, the linear on real-model weights and a small MoE "
              "layer of each family, each against the float64 reference, in one table (CPU: about 6 s)"),
    "bench": ("jaxfp8.tools.bench", "time every op (--ops=quant,gemm,linear,linear_grad,grouped,moe,valid_rows), "
              "implementation and baseline in one run, each output checked first: a table, --out JSON and markdown "
              "(GPU: CUPTI kernel times; CPU: wall clock of the XLA paths on tiny problems)"),
    "tune": ("jaxfp8.tools.tune", "GPU: time the Triton GEMM configs of a declared search space per (shape, M "
             "bucket), write the fastest into a config table (--out)"),
    "plot": ("jaxfp8.tools.plot", "plot a results JSON of bench or tp (needs matplotlib)"),
    "tp": ("jaxfp8.tools.tp", "tensor-parallel linears over every local device, checked and timed against one device"),
}
DEFAULT = "check"
HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "--helpfull", "-?")


def overview() -> str:
  width = max(map(len, COMMANDS))
  lines = [f"usage: {PROG} [COMMAND] [--flag=value ...]", "", "commands:"]
  for name, (_, summary) in COMMANDS.items():
    lines += textwrap.wrap(summary, 116, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))
  lines += ["", f"{PROG} COMMAND --help lists that command's flags."]
  return "\n".join(lines)


def command_help(name: str, module) -> str:
  flag_lines = module.FLAGS.module_help(module.__name__).strip().splitlines()[1:]  # without the module's name
  return "\n".join([f"usage: {PROG} {name} [--flag=value ...]", "", (module.__doc__ or "").strip(), "",
                    "flags:", *flag_lines])


def _fail(prog: str, message: str, status: int) -> int:
  message = re.sub(r"flag --(\w+)=None: Flag --\w+ must have a value other than None\.", r"--\1 is required.", message)
  print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)
  return status


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command of `argv` (sys.argv by default); returns the exit status."""
  rest = list(sys.argv[1:] if argv is None else argv[1:])
  named = bool(rest) and not rest[0].startswith("-")
  name = rest.pop(0) if named else DEFAULT
  if name == "help" or (not named and set(rest) & set(HELP_FLAGS)):
    module = importlib.import_module(COMMANDS[DEFAULT][0])
    print(overview() + "\n\n" + command_help(DEFAULT, module))
    return 0
  if name not in COMMANDS:
    return _fail(PROG, f"unknown command {name!r}; commands: {', '.join(COMMANDS)} ({PROG} --help)", 2)
  # bench times torch beside JAX on one GPU: JAX must not take 75% of its memory up front (read when JAX starts).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  module = importlib.import_module(COMMANDS[name][0])
  prog = f"{PROG} {name}"
  if set(rest) & set(HELP_FLAGS):
    print(command_help(name, module))
    return 0
  module.FLAGS.unparse_flags()  # a second run in the same process starts from the defaults
  try:
    positional = module.FLAGS([prog, *rest])[1:]
    if positional:
      raise args.UsageError(f"unexpected arguments {positional}: flags are --name=value ({prog} --help)")
    return int(module.main(shlex.join([*PROG.split(), name, *rest])) or 0)
  except flags.Error as e:
    return _fail(prog, f"{e} ({prog} --help)", 2)
  except args.CommandError as e:
    return _fail(prog, str(e), e.status)
