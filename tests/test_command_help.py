"""A command's `--help` builds its parser only: the commands whose flags need no torch load none.

generate, serve, stage, gate and ping are not listed: their flags' choices come from wire/ and
transport/ modules that import torch themselves.
"""

from __future__ import annotations

import subprocess
import sys

LIGHT = ("demo", "worker", "bench", "make-model", "slice", "wan", "info", "keygen", "relay", "profile", "plan", "dht",
         "manifest", "seed", "fetch-slice", "invite", "join", "status")


def test_light_commands_help_loads_neither_torch_nor_transformers():
    code = (
        "import sys\nfrom moeswarm.cli import main\n"
        f"for command in {LIGHT!r}:\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, command\n"
        "    heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "    print(command, heavy, file=sys.stderr)\n"
        "    assert not heavy, (command, heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
