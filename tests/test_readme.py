"""The README's Training block, run as a user would: word for word, in a fresh folder
with the environment `make` created, on the README's own inputs (a folder of text and
some log files, made here)."""

import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_block(heading: str) -> str:
    """The first ```bash block under ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_readmes_training_block_runs_word_for_word(tmp_path):
    venv = ROOT / ".venv"
    if not (venv / "bin" / "activate").exists():
        pytest.skip("needs the .venv that make creates")
    (tmp_path / ".venv").symlink_to(venv)
    corpus = tmp_path / "my_corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "dataclasses.py", "textwrap.py", "shutil.py", "pathlib.py"):
        shutil.copy(stdlib / name, corpus / name.replace(".py", ".txt"))
    (tmp_path / "logs").mkdir()
    for i in range(3):
        (tmp_path / "logs" / f"{i}.txt").write_text(f"job {i} finished\n" * 200)
    block = readme_block("## Training")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = tmp_path / "runs" / "mine"
    assert (run / "final.h5").is_file() and (run / "summary.json").is_file()
    assert (run / "report" / "report.html").is_file()
    assert (tmp_path / "datasets" / "logs.h5").is_file()
    steps = [json.loads(line).get("step") for line in
             (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 100  # the README's --train.max_iters
