"""`python -m jaxfp8 [COMMAND] [--flag=value ...]`: check (the default), bench, tune, plot, tp.

`python -m jaxfp8 --help` lists the commands, `python -m jaxfp8 COMMAND --help` a command's flags. The commands live
in jaxfp8.tools (jaxfp8.tools.cli), which `import jaxfp8` does not load.
"""

import sys

from jaxfp8.tools import cli

if __name__ == "__main__":
  sys.exit(cli.main(sys.argv))
