"""Several nodes without SLURM: two ``monai-fast launch`` processes on this machine act as two nodes
(static rendezvous at --master-addr, and c10d at --rdzv-endpoint); each rank's node in the record and the doctor."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from drill import run_local_nodes, static_nodes
from ignite.engine import Engine

from monai_fast.apps.launch import free_port
from monai_fast.distributed import detect
from monai_fast.handlers import RecordHandler
from monai_fast.report.doctor import diagnose
from monai_fast.telemetry.record import Kind, Source, load_record, select

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorials" / "distributed_train.py"


@pytest.mark.parametrize(
    "env, node_rank, nnodes",
    [
        (
            {
                "TORCHELASTIC_RUN_ID": "j",
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2",
            },
            1,
            2,
        ),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "2",
                "SLURM_NNODES": "4",
            },
            2,
            4,
        ),
        (
            {
                "HOROVOD_RANK": "3",
                "HOROVOD_SIZE": "4",
                "HOROVOD_LOCAL_RANK": "1",
                "HOROVOD_CROSS_RANK": "1",
                "HOROVOD_CROSS_SIZE": "2",
            },
            1,
            2,
        ),
        ({}, 0, 1),
    ],
)
def test_detect_reads_the_node_rank_and_node_count_of_each_launcher(env, node_rank, nnodes):
    found = detect(env)
    assert (found.node_rank, found.nnodes) == (node_rank, nnodes)


def test_detect_names_a_bad_node_variable():
    with pytest.raises(ValueError, match="GROUP_RANK='one'"):
        detect({"TORCHELASTIC_RUN_ID": "j", "WORLD_SIZE": "2", "GROUP_RANK": "one"})


def test_record_handler_writes_where_the_rank_runs(tmp_path, monkeypatch):
    for k, v in {
        "TORCHELASTIC_RUN_ID": "j",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "3",
        "GROUP_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(k, v)
    trainer = Engine(lambda e, b: None)
    RecordHandler(tmp_path).attach(trainer)
    trainer.run([0, 1], max_epochs=1)
    rows = [r for r in select(load_record(tmp_path)[0], Kind.EVENT, Source.RECORD) if r.get("what") == "placement"]
    assert len(rows) == 1
    assert rows[0]["host"] == socket.gethostname() and rows[0]["node_rank"] == 3 and rows[0]["nnodes"] == 4
    assert rows[0]["launcher"] == "torchrun" and rows[0]["rank"] == 0


def _rank_rows(rank: int, node: int, host: str) -> list[dict]:
    return [
        {
            "kind": "event",
            "source": "record",
            "rank": rank,
            "what": "placement",
            "host": host,
            "node_rank": node,
            "launcher": "torchrun",
        },
        {
            "kind": "epoch",
            "source": "time_breakdown",
            "rank": rank,
            "engine": "train",
            "epoch": 1,
            "iterations": 2,
            "data_s": 0.1,
            "compute_s": 1.0,
        },
    ]


def test_doctor_lists_each_node_and_its_ranks():
    rows = _rank_rows(0, 0, "a") + _rank_rows(1, 0, "a") + _rank_rows(2, 1, "b") + _rank_rows(3, 1, "b")
    d = diagnose(rows)
    assert "4 ranks on 2 node(s) (torchrun): node 0 on a: ranks 0, 1; node 1 on b: ranks 2, 3" in d.evidence
    assert d.numbers["nodes"] == [
        {"node_rank": 0, "host": "a", "ranks": [0, 1]},
        {"node_rank": 1, "host": "b", "ranks": [2, 3]},
    ]


def test_two_launch_processes_on_localhost_train_as_two_nodes_with_equal_weights(tmp_path, tiny_spleen):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    done = run_local_nodes(
        static_nodes(2, free_port()),
        [
            str(TUTORIAL),
            "--tiny",
            "--fp32",
            "--data-dir",
            str(tiny_spleen),
            "--out",
            str(out),
            "--max-epochs",
            "1",
            "--run-dir",
            str(run_dir),
        ],
        tmp_path,
    )
    for rc, log in done:
        assert rc == 0, log[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == r1["launcher"] == "torchrun" and r0["world_size"] == r1["world_size"] == 2
    assert r0["weights_sha1"] == r1["weights_sha1"]  # one DDP job across the two "nodes"
    assert r0["train_items"] == r1["train_items"] == 2  # each node's rank took its share
    placements = {
        r["rank"]: r["node_rank"]
        for r in select(load_record(run_dir)[0], Kind.EVENT, Source.RECORD)
        if r.get("what") == "placement"
    }
    assert placements == {0: 0, 1: 1}
    doc = subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "doctor", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert doc.returncode == 0, doc.stderr[-3000:]
    host = socket.gethostname()
    assert f"2 ranks on 2 node(s) (torchrun): node 0 on {host}: rank 0; node 1 on {host}: rank 1" in doc.stdout, (
        doc.stdout
    )


def test_two_launch_processes_meet_at_a_c10d_rendezvous(tmp_path):
    script = tmp_path / "meet.py"
    script.write_text(
        "import json, sys, torch\n"
        "from ignite import distributed as idist\n"
        "from monai_fast.distributed import detect\n"
        "from monai_fast.apps.launch import run\n"
        "def train(local_rank, out):\n"
        "    total = idist.all_reduce(torch.tensor([float(idist.get_rank() + 1)])).item()\n"
        "    env = detect()\n"
        "    open(f'{out}/r{idist.get_rank()}.json', 'w').write(json.dumps({'sum': total, 'launcher': env.launcher,\n"
        "        'world': env.world_size, 'node_rank': env.node_rank, 'nnodes': env.nnodes}))\n"
        "run(train, sys.argv[1])\n"
    )
    c10d = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "mn-test"]
    done = run_local_nodes([c10d, c10d], [str(script), str(tmp_path)], tmp_path, timeout_s=240)
    for rc, log in done:
        assert rc == 0, log[-3000:]
    r = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1)]
    assert all(x["sum"] == 3.0 and x["launcher"] == "torchrun" and x["world"] == 2 and x["nnodes"] == 2 for x in r)
    assert sorted(x["node_rank"] for x in r) == [0, 1]  # torchrun numbered the nodes
