"""The rest of every notebook's first cell, which finds the course's folder (or clones it, on a fresh runtime such
as Colab) and then calls `course_helpers(root)` from this file.

Every failure ends in one message that says what to do (SystemExit, shown without a traceback).
"""

import importlib
import pathlib
import subprocess
import sys
import threading
from importlib.metadata import PackageNotFoundError, distribution
from types import ModuleType

CLONE_NAME = "gpt-from-scratch-fast"  # the folder the first cell clones into, in the working folder
PROGRESS = ("Collecting", "Installing collected packages", "Successfully installed")  # pip's lines worth showing


def run_pip(command: list[str], timeout_s: float = 900) -> None:
    """Run the pip `command`, printing its progress lines as they come (a quiet pip shows nothing for minutes)."""
    print("Installing the course and the packages it needs (a few minutes on a fresh runtime):", flush=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    last = "no output"
    for line in proc.stdout:
        if line.strip():
            last = line.strip()
        if line.startswith(PROGRESS):
            print("  " + line.strip()[:150], flush=True)
    proc.wait()
    timer.cancel()
    if proc.returncode:
        reason = f"it did not finish within {timeout_s:.0f} s" if proc.returncode < 0 else last
        raise SystemExit(f"setup failed at `pip install`: {reason}\nCheck that this runtime reaches the internet, "
                         "or install the course yourself: pip install --editable FOLDER_OF_THE_CLONE")


def is_installed(name: str = "gpt-from-scratch-fast") -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def course_helpers(root: pathlib.Path) -> ModuleType:
    """The course's `helpers`, imported from `root`. A clone the first cell made (in the working folder) is
    installed first if it is not yet; a clone of yours is used as it is, so edits to its helpers/ take effect."""
    root = pathlib.Path(root).resolve()
    if root == pathlib.Path.cwd().resolve() / CLONE_NAME and not is_installed():
        run_pip([sys.executable, "-m", "pip", "install", "--progress-bar", "off", "--editable", str(root)])
        importlib.invalidate_caches()  # this interpreter sees the packages pip just added
    sys.path.insert(0, str(root))  # the course's helpers before any other module of that name
    try:
        import helpers
    except ImportError as err:
        raise SystemExit(f"the course's helpers need packages this Python lacks ({err}): run `make lab` in {root}, "
                         f"or `pip install --editable {root}`") from None
    if pathlib.Path(helpers.__file__).resolve().parent != root / "helpers":
        raise SystemExit(f"`import helpers` gave {helpers.__file__}, not the course's: restart the kernel")
    return helpers
