"""`CheckpointFolder` on real ignite engines and real files."""

from __future__ import annotations

import torch
from ignite.engine import Engine

from monai_fast.handlers.checkpoint_folder import CheckpointFolder


def test_a_folder_given_from_the_home_folder_is_written_pruned_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # a literal "~" folder would appear here
    trainer = Engine(lambda e, b: None)
    folder = CheckpointFolder({"trainer": trainer, "model": torch.nn.Linear(2, 1)}, "~/ckpts", n_saved=1)
    trainer.run([0, 1], max_epochs=1)
    first = folder.write(trainer)
    trainer.run([0, 1, 2], max_epochs=2)
    second = folder.write(trainer)
    assert first.parent == second.parent == tmp_path / "ckpts"
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [second.name]  # pruned to n_saved
    newest = folder.newest_loadable()
    assert newest is not None and newest[0] == second and set(newest[1]) == {"trainer", "model"}
    assert not (tmp_path / "~").exists()
