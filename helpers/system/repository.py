"""Where the course lives: its public repository, and the clone `helpers` was installed from (if any)."""

from pathlib import Path

REPOSITORY_URL = "https://github.com/gpt-from-scratch-fast/gpt-from-scratch-fast"
REVISION = "main"  # the branch or tag a fresh runtime clones: a release tag pins notebooks to their code
ROOT = Path(__file__).resolve().parents[2]
