"""The cache core is pure Python: importing it must not import torch (nor the engine layers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CORE = sorted(p.stem for p in (Path(__file__).parents[2] / "kvpool" / "core").glob("*.py")
              if p.stem != "__init__")


def test_importing_every_core_module_imports_no_torch(tmp_path: Path) -> None:
    # A poisoned `torch` first on the path: importing it at all fails the import of the core.
    (tmp_path / "torch.py").write_text("raise ImportError('kvpool.core imported torch')\n")
    code = (
        "import sys\n"
        f"for m in {CORE!r}: __import__('kvpool.core.' + m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith(('kvpool.runner', 'kvpool.engine', 'kvpool.server'))]\n"
        "assert not bad, bad\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
    assert len(CORE) >= 8
