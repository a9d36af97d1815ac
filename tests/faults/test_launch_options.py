"""Bad ``monai-fast launch`` node options end in one error naming each bad option, before anything starts."""

from __future__ import annotations

import pytest

from monai_fast.apps.cli import main
from monai_fast.apps.launch.torchrun import LaunchSpec, torchrun_args


@pytest.fixture
def script(tmp_path):
    """A training script that leaves a marker if it ever runs."""
    path = tmp_path / "train.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    return path


@pytest.mark.parametrize(
    "opts, named",
    [
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1"],
            ["--node-rank 2 must be below --nnodes 2"],
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "head", "--rdzv-id", "j"], ["--rdzv-endpoint 'head' is not HOST:PORT"]),
        (
            ["--nnodes", "2", "--master-addr", "head", "--rdzv-endpoint", "head:29400", "--rdzv-id", "j"],
            ["--master-addr cannot be mixed with the c10d rendezvous"],
        ),
        (
            ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29400", "--rdzv-id", "j"],
            ["--node-rank cannot be mixed with the c10d rendezvous"],
        ),
        (["--nnodes", "2"], ["--nnodes 2 needs where the nodes meet"]),
        (["--nnodes", "2", "--master-addr", "head"], ["needs this node's --node-rank"]),
        (["--nnodes", "2", "--rdzv-endpoint", "head:29400"], ["--rdzv-endpoint needs --rdzv-id"]),
        (["--rdzv-id", "j"], ["--rdzv-id needs --rdzv-endpoint"]),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "head:29500"],
            ["--master-addr 'head:29500'", "--master-port"],
        ),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "head", "--master-port", "70000"],
            ["--master-port 70000"],
        ),
        (["--nnodes", "0"], ["--nnodes must be >= 1"]),
        (["--max-restarts", "-1"], ["--max-restarts must be >= 0"]),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-addr", "head", "--max-restarts", "1"],
            ["--max-restarts 1 across 2 nodes needs the c10d rendezvous"],
        ),
    ],
)
def test_a_bad_node_option_is_named_and_nothing_starts(opts, named, script, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["launch", "--nproc", "1", *opts, str(script)])
    assert str(e.value).startswith("monai-fast launch: ")
    for text in named:
        assert text in str(e.value), str(e.value)
    assert not (tmp_path / "ran").exists()


def test_every_bad_option_is_named_in_the_one_error(script, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "launch",
                "--nproc",
                "0",
                "--nnodes",
                "2",
                "--node-rank",
                "5",
                "--master-addr",
                "head",
                "--master-port",
                "0",
                "--grace-s",
                "-1",
                str(tmp_path / "missing.py"),
            ]
        )
    message = str(e.value)
    for flag in ("--nproc", "--node-rank 5", "--master-port 0", "--grace-s", "missing.py not found"):
        assert flag in message, (flag, message)
    assert message.count("monai-fast launch:") == 1


@pytest.mark.parametrize(
    "spec, expected",
    [
        (LaunchSpec(nproc=2), ["--standalone", "--nproc-per-node=2", "--max-restarts=0"]),
        (
            LaunchSpec(nproc=4, nnodes=2, node_rank=1, master_addr="10.0.0.1"),
            [
                "--nnodes=2",
                "--node-rank=1",
                "--master-addr=10.0.0.1",
                "--master-port=29500",
                "--rdzv-backend=static",
                "--nproc-per-node=4",
                "--max-restarts=0",
            ],
        ),
        (
            LaunchSpec(nproc=1, nnodes=3, rdzv_endpoint="[::1]:29400", rdzv_id="job", max_restarts=2),
            [
                "--nnodes=3",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=[::1]:29400",
                "--rdzv-id=job",
                "--nproc-per-node=1",
                "--max-restarts=2",
            ],
        ),
    ],
)
def test_each_form_passes_its_rendezvous_and_restarts_to_torchrun(spec, expected):
    assert torchrun_args(spec) == [*expected, "--monitor-interval=1"]
