"""The one decision "show a progress bar?" (monai_fast.progress), on real streams and a real pseudo-terminal."""

from __future__ import annotations

import os
import pty

from monai_fast.progress import progress_bar, show_progress


def test_show_progress_is_false_for_a_file_stream(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert show_progress(True, stream=f) is False


def test_show_progress_is_true_for_a_pseudo_terminal():
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            assert show_progress(True, stream=tty) is True
            assert show_progress(False, stream=tty) is False  # asked for no bars: none, even on a terminal
    finally:
        os.close(leader)
        os.close(follower)


def test_progress_bar_is_disabled_where_stderr_is_not_a_terminal(capfd):
    # pytest's captured stderr is not a terminal: the bar asked for is not drawn
    assert list(progress_bar(range(3), enabled=True, desc="items")) == [0, 1, 2]
    assert "items" not in capfd.readouterr().err
