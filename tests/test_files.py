import os
import stat

from helpers.system.files import atomic_path


def test_an_atomically_written_file_gets_the_usual_mode_not_a_temporary_files(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "results.json") as tmp:
            tmp.write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == 0o644
