"""opjit.torch is optional (issue 32 item 6): `import opjit` works without
PyTorch, `import opjit.torch` says what is missing, and the pip package
declares torch as the `torch` extra. Needs no torch and no daemon."""

import os
import subprocess
import sys

from conftest import REPO

NO_TORCH = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named %r (blocked by the test)" % name)
sys.meta_path.insert(0, Block())
import opjit
assert "torch" not in sys.modules
print("opjit", opjit.__version__, opjit.Client.__name__)
try:
    import opjit.torch
except ImportError as e:
    print("opjit.torch: ImportError:", e)
"""


def test_import_opjit_without_torch():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=60, env=os.environ)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "opjit 0.1.0 Client" in proc.stdout
    assert "opjit.torch: ImportError: opjit.torch needs PyTorch" in proc.stdout
    assert "python3-torch" in proc.stdout


def test_pip_metadata_has_torch_extra():
    backend = os.path.join(REPO, "client", "python", "_build_backend")
    proc = subprocess.run([sys.executable, "-c", "import opjit_build; print(opjit_build._metadata())"],
                          cwd=backend, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.split("\n\n", 1)[0].splitlines()
    assert "Provides-Extra: torch" in head
    assert 'Requires-Dist: torch>=1.13; extra == "torch"' in head
    assert not any(line.startswith("Requires-Dist: torch") and "extra" not in line
                   for line in head)
