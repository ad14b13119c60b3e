"""Write GPT-2's BPE ranks (tiktoken's ``r50k_base.tiktoken``) to a path, from PyPI.

    python tests/fetch_gpt2_bpe.py .venv/share/hpctrain/r50k_base.tiktoken

``make test-hf`` runs this. tiktoken downloads the file from OpenAI's blob store on first
use, which compute nodes and this project's test machines cannot reach; openai-whisper's
sdist (MIT licence) ships the same bytes as ``whisper/assets/gpt2.tiktoken``, and pip can
fetch that sdist from any configured index. Only the one file is kept: whisper itself is
not installed (it would pull numba and triton), and nothing of it goes into the repository.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "openai-whisper==20250625"  # published as an sdist only
MEMBER = "whisper/assets/gpt2.tiktoken"
# The sha256 tiktoken expects of r50k_base.tiktoken (tiktoken_ext/openai_public.py); it
# checks it again when it reads the file from its cache, so a wrong file fails twice.
SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def extract(sdist: Path) -> bytes:
    """The rank file's bytes from the sdist (its members sit under one top folder)."""
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.split("/", 1)[-1] == MEMBER:
                return tar.extractfile(member).read()
    raise SystemExit(f"{sdist.name} has no {MEMBER}")


def main(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "-d", tmp, SDIST], check=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise SystemExit(f"expected one sdist of {SDIST}, pip gave {sorted(archives)}")
        data = extract(archives[0])
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{MEMBER} in {SDIST} has sha256 {digest}, not r50k_base's {SHA256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    part.replace(dest)  # whole or absent: make takes an existing file as done
    print(f"GPT-2 BPE ranks ({len(data.splitlines())} tokens) -> {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/fetch_gpt2_bpe.py DEST")
    main(Path(sys.argv[1]))
