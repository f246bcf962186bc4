"""The user docs' examples, run as written.

Every fenced ```python block in docs/*.md that follows a `<!-- run -->` line
runs as its own script against the test daemon (OPJIT_SERVER), from the
repository's root as the docs say, and must exit 0: its own asserts check
the numbers it shows. Blocks without the marker show a framework's own code
(torch, Paddle, MindSpore), which is not what opjit runs.
"""

import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

_BLOCK = re.compile(r"<!-- run -->\s*\n```python\n(.*?)\n```", re.S)


def _blocks():
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))):
        with open(path) as f:
            text = f.read()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(pytest.param(m.group(1), id="%s:%d" % (os.path.basename(path), line)))
    return out


BLOCKS = _blocks()


def test_docs_have_runnable_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS)
def test_docs_example(code, daemon, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code + "\n")
    env = dict(os.environ, OPJIT_SERVER=daemon.unix_address)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, "the example failed (%d):\n%s\n---\n%s" % (
        proc.returncode, code, proc.stdout + proc.stderr)
