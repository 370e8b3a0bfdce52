"""Where the course lives: its public repository, and the clone `helpers` was installed from (if any)."""

from pathlib import Path

REPOSITORY_URL = "https://github.com/gpt-from-scratch-fast/gpt-from-scratch-fast"
ROOT = Path(__file__).resolve().parents[2]
