"""The distributed layer: launcher detection, local spawn, the tutorial under real torchrun with 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ignite import distributed as idist
from tutorial_runs import tutorial_args

from monai_fast.apps.launch import run
from monai_fast.distributed import LaunchEnv, detect, pick_backend
from monai_fast.distributed.model import fix_zero_grad_signature, rank_share

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "tutorials" / "distributed_train.py"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, LaunchEnv("none")),
        (
            {"TORCHELASTIC_RUN_ID": "1", "LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4"},
            LaunchEnv("torchrun", 4, 3, 1),
        ),
        ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1"}, LaunchEnv("horovod", 2, 1, 1)),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "HOROVOD_GLOO": "0",
            },
            LaunchEnv("horovod", 2, 1, 1),
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"},
            LaunchEnv("slurm", 2, 1, 1),
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
            LaunchEnv("none"),
        ),  # sbatch's one-task batch step
        # torchrun inside a SLURM allocation: torchrun made the ranks
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "1",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "RANK": "0",
            },
            LaunchEnv("torchrun", 2, 0, 0),
        ),
    ],
)
def test_detect_launcher(env, expected):
    assert detect(env) == expected


def test_detect_names_a_bad_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        detect({"LOCAL_RANK": "0", "WORLD_SIZE": "two"})


def test_pick_backend():
    assert pick_backend(LaunchEnv("none"), cuda=False) is None
    assert pick_backend(LaunchEnv("none"), cuda=False, nproc_per_node=2) == "gloo"
    assert pick_backend(LaunchEnv("torchrun", 2), cuda=True) == "nccl"
    assert pick_backend(LaunchEnv("slurm", 2), cuda=False) == "gloo"
    assert pick_backend(LaunchEnv("horovod", 2), cuda=True) == "horovod"


def _collect(local_rank, out_dir):
    t = torch.tensor([float(idist.get_rank() + 1)])
    total = idist.all_reduce(t).item()
    seed_draw = torch.rand(1).item()  # seeds differ per rank
    Path(out_dir, f"r{idist.get_rank()}.json").write_text(
        json.dumps(
            {
                "local_rank": local_rank,
                "world": idist.get_world_size(),
                "sum": total,
                "backend": idist.backend(),
                "draw": seed_draw,
                "threads": torch.get_num_threads(),
            }
        )
    )


def test_run_spawns_local_gloo_ranks(tmp_path):
    run(_collect, str(tmp_path), nproc_per_node=2)
    r = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1)]
    assert [x["local_rank"] for x in r] == [0, 1]
    assert all(x["world"] == 2 and x["sum"] == 3.0 and x["backend"] == "gloo" for x in r)
    assert r[0]["draw"] != r[1]["draw"]
    assert all(x["threads"] == max(1, (os.cpu_count() or 1) // 2) for x in r)


def test_run_single_process_and_bad_arguments(tmp_path, monkeypatch):
    run(_collect, str(tmp_path))  # plain python: no process group
    assert json.loads((tmp_path / "r0.json").read_text())["world"] == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="already started by torchrun"):
        run(_collect, str(tmp_path), nproc_per_node=2)


def test_rank_share_single_process():
    files = [{"image": f"i{i}"} for i in range(5)]
    assert rank_share(files) == files and rank_share(files, even=False) == files


def test_zero_grad_fix_for_optimizers_without_set_to_none():
    net = torch.nn.Linear(3, 1)

    class OldStyle(torch.optim.SGD):  # the signature Horovod's DistributedOptimizer has
        def zero_grad(self):
            super().zero_grad(set_to_none=False)

    opt = OldStyle(net.parameters(), lr=0.1)
    with pytest.raises(TypeError):
        opt.zero_grad(set_to_none=True)
    fixed = fix_zero_grad_signature(opt)
    net(torch.ones(2, 3)).sum().backward()
    fixed.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in net.parameters())
    net(torch.ones(2, 3)).sum().backward()
    fixed.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    plain = torch.optim.SGD(net.parameters(), lr=0.1)
    assert fix_zero_grad_signature(plain).zero_grad == plain.zero_grad  # untouched


def _launch(args, tmp_path, timeout=420):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "monai_fast.apps.cli", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tmp_path,
    )


def test_tutorial_under_torchrun_two_gloo_ranks(two_rank_reference):
    # the shared reference run is the tutorial under `monai-fast launch --nproc 2` (fp32, batch 1, 3 epochs)
    r0, r1 = (json.loads((two_rank_reference / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == r1["launcher"] == "torchrun" and r0["world_size"] == 2 and r0["backend"] == "gloo"
    assert r0["weights_sha1"] == r1["weights_sha1"]  # DDP kept the weights identical
    assert r0["val_mean_dice"] == r1["val_mean_dice"]  # the metric was gathered over both ranks' cases
    assert r0["train_items"] == r1["train_items"] == 2  # 4 training cases, 2 per rank: each caches its share
    assert r0["val_items"] + r1["val_items"] == 2
    assert r0["iterations"] == r1["iterations"] == 6  # batch 1: 2 batches per epoch per rank, 3 epochs


@pytest.mark.parametrize("ending", ["", "    raise SystemExit(0)\n"], ids=["returns", "raises"])
def test_run_joins_the_process_group_threads_before_exit(tmp_path, ending):
    """A DDP model held in a reference cycle (as ignite engines hold theirs) must not keep the gloo
    process group, and its worker threads, alive into interpreter shutdown: there they abort the
    process ("terminate called without an active exception") after the job has done its work. Also
    when the function ends by raising (a preempted run's ``exit_if_preempted``), whose traceback
    holds its frames."""
    script = tmp_path / "cycle.py"
    script.write_text(
        "import os, torch, ignite.distributed as idist\n"
        "from monai_fast.apps.launch import run\n"
        "def threads():\n"
        "    return len(os.listdir('/proc/self/task'))\n"
        "def train(local_rank):\n"
        "    holder = {'net': idist.auto_model(torch.nn.Conv3d(1, 2, 3))}\n"
        "    holder['self'] = holder\n"
        "    holder['net'](torch.rand(1, 1, 8, 8, 8)).sum().backward()\n"
        "    idist.all_gather(torch.ones(1))\n"
        "    os.write(1, f'during {threads()}\\n'.encode())\n"
        f"{ending}"
        "before = threads()\n"
        "try:\n"
        "    run(train)\n"
        "except SystemExit:\n"
        "    pass\n"
        "os.write(1, f'threads {before} {threads()}\\n'.encode())\n"
    )
    p = _launch(["--nproc", "2", str(script)], tmp_path, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    during = [int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("during")]
    after = [line.split()[1:] for line in p.stdout.splitlines() if line.startswith("threads")]
    assert len(during) == len(after) == 2, p.stdout
    assert all(d > int(b) for d, (b, _) in zip(during, after)), (during, after)  # gloo started threads...
    assert all(b == a for b, a in after), after  # ...and they are gone once run() returns


def test_tutorial_single_process_has_the_same_entry(tmp_path, tiny_spleen):
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            str(TUTORIAL),
            "--tiny",
            "--data-dir",
            str(tiny_spleen),
            "--out",
            str(out),
            "--max-epochs",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r0 = json.loads((out / "rank0.json").read_text())
    assert r0["world_size"] == 1 and r0["launcher"] == "none" and r0["train_items"] == 4


def test_a_killed_rank_stops_the_job_quickly(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal, time, torch\n"
        "from ignite import distributed as idist\n"
        "from monai_fast.apps.launch import run\n"
        "def train(local_rank):\n"
        "    for step in range(10**6):\n"
        "        idist.all_reduce(torch.ones(1))\n"
        "        if step == 20 and idist.get_rank() == 1:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        time.sleep(0.01)\n"
        "run(train)\n"
    )
    t = time.monotonic()
    p = _launch(["--nproc", "2", str(script)], tmp_path, timeout=180)
    took = time.monotonic() - t
    assert p.returncode != 0
    assert "SIGKILL" in p.stderr or "Signal 9" in p.stderr or "exitcode  : -9" in p.stderr, p.stderr[-3000:]
    assert took < 120  # bounded: torchrun tears the survivor down; no hang until a collective timeout


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real one-node SLURM cluster (slurmctld + slurmd + munged) for this test session."""
    import slurm_cluster

    why = slurm_cluster.missing_parts()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    env = slurm_cluster.up(root)
    yield env
    slurm_cluster.down(root)


def test_tutorial_under_srun(slurm, tmp_path, tiny_spleen):
    out = tmp_path / "out"
    p = subprocess.run(
        [
            "srun",
            "-n",
            "2",
            sys.executable,
            str(TUTORIAL),
            "--tiny",
            "--data-dir",
            str(tiny_spleen),
            "--out",
            str(out),
            "--max-epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=slurm,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == r1["launcher"] == "slurm" and r0["world_size"] == 2
    assert r0["weights_sha1"] == r1["weights_sha1"] and r0["val_mean_dice"] == r1["val_mean_dice"]
    assert r0["train_items"] == r1["train_items"] == 2


def test_tutorial_under_sbatch(slurm, tmp_path, tiny_spleen):
    out = tmp_path / "out"
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --job-name=mf-test\n"
        f"srun {sys.executable} {TUTORIAL} --tiny --data-dir {tiny_spleen} --out {out} --max-epochs 2\n"
    )
    p = subprocess.run(
        ["sbatch", "--wait", "-o", str(tmp_path / "slurm-%j.out"), str(job)],
        capture_output=True,
        text=True,
        timeout=300,
        env=slurm,
    )
    logs = "".join(f.read_text() for f in tmp_path.glob("slurm-*.out"))
    assert p.returncode == 0, p.stderr + logs[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == "slurm" and r0["weights_sha1"] == r1["weights_sha1"]


def _job_state(job: str, env) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return f"{fields.get('JobState', '?')}/{fields.get('Reason', '?')}/{fields.get('Restarts', '?')}"


def test_sbatch_job_preempted_requeues_and_resumes(slurm, tmp_path, tiny_spleen):
    ref = subprocess.run(
        [sys.executable, *tutorial_args(tiny_spleen, tmp_path / "ref")], capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    expected = json.loads((tmp_path / "ref" / "rank0.json").read_text())

    prog, out = tmp_path / "progress", tmp_path / "out"
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=1\n#SBATCH --requeue\n"
        f"exec {sys.executable} "
        + " ".join(
            tutorial_args(tiny_spleen, out, "--checkpoint-dir", str(tmp_path / "ckpt"), "--progress-file", str(prog))
        )
        + "\n"
    )
    jid = (
        subprocess.run(
            ["sbatch", "--parsable", "--open-mode=append", "-o", str(tmp_path / "slurm-%j.out"), str(job)],
            capture_output=True,
            text=True,
            check=True,
            env=slurm,
        )
        .stdout.strip()
        .split(";")[0]
    )
    deadline = time.monotonic() + 300
    while len(prog.read_text().split() if prog.exists() else []) < 6:
        assert time.monotonic() < deadline, _job_state(jid, slurm)
        time.sleep(0.02)
    # what SLURM does before a preemption or the time limit with --signal=B:USR1@<seconds>
    subprocess.run(["scancel", "--batch", "--signal=USR1", jid], check=True, env=slurm)
    seen = set()
    held_since = None
    while True:
        state = _job_state(jid, slurm)
        seen.add(state.split("/")[0])
        node = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=slurm
        ).stdout.strip()
        if state.startswith("PENDING/BeginTime"):
            held_since = held_since or time.monotonic()
        if state.startswith("PENDING/BeginTime") and node == "idle" and time.monotonic() - held_since > 2.5:
            # SLURM holds a requeued job for 2 minutes because slurmd revoked the first run's job
            # credential, and a credential made in the same wall-clock second as the revocation counts
            # as revoked too ("Killing non-startable batch job: Job credential revoked"; it failed
            # the suite here once when started within that second). With the first run torn down
            # (node idle) and that second past, start it now.
            subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], check=True, env=slurm)
        if state.startswith("COMPLETED"):
            break
        # (a requeued job may show FAILED or CANCELLED for a moment while its first run is torn down)
        assert time.monotonic() < deadline, f"{state}; states seen {sorted(seen)}"
        time.sleep(0.5)
    logs = "".join(f.read_text() for f in tmp_path.glob("slurm-*.out"))
    assert state.startswith("COMPLETED") and state.endswith("/1"), state + logs[-3000:]  # one restart
    assert "PENDING" in seen and "requeued" in logs
    got = json.loads((out / "rank0.json").read_text())
    steps = [int(x) for x in prog.read_text().split()]
    assert got["resumed_from"] is not None and steps == list(range(1, 13))  # no completed iteration lost or repeated
    assert got["weights_sha1"] == expected["weights_sha1"]


def _need_horovod():
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        pytest.skip("Horovod is not built here: python scripts/build_horovod.py (the CI does)")
    exe = Path(sys.executable).parent / "horovodrun"
    return str(exe) if exe.exists() else "horovodrun"


def test_tutorial_under_horovodrun(tmp_path, tiny_spleen):
    horovodrun = _need_horovod()
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    p = subprocess.run(
        [
            horovodrun,
            "-np",
            "2",
            "--gloo",
            sys.executable,
            str(TUTORIAL),
            "--tiny",
            "--data-dir",
            str(tiny_spleen),
            "--out",
            str(out),
            "--max-epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == r1["launcher"] == "horovod" and r0["backend"] == "horovod"
    assert r0["weights_sha1"] == r1["weights_sha1"]  # Horovod's DistributedOptimizer averaged the gradients
    assert r0["val_mean_dice"] == r1["val_mean_dice"]
    assert r0["train_items"] == r1["train_items"] == 2


def test_sbatch_generator_checks_options():
    from monai_fast.apps.launch.jobs import SbatchSpec, render_sbatch

    text = render_sbatch(
        SbatchSpec(["python", "train.py", "--lr", "1e-3"], nodes=4, gpus_per_node=8, time="1-00:00:00", partition="gpu")
    )
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1-00:00:00",
        "# 32 ranks",
    ):
        assert line in text, line
    assert text.rstrip().endswith("srun --kill-on-bad-exit=1 python train.py --lr 1e-3")
    with pytest.raises(ValueError, match="time '4h'"):
        SbatchSpec(["python", "t.py"], time="4h")
    with pytest.raises(ValueError, match="command is empty"):
        SbatchSpec([])
    with pytest.raises(SystemExit, match=r"^monai-fast sbatch: nodes must be >= 1"):  # the command named, not its argv
        from monai_fast.apps.cli import main

        main(["sbatch", "--nodes", "0", "--", "python", "t.py"])


def test_generated_sbatch_script_runs_on_the_cluster(slurm, tmp_path, tiny_spleen):
    from monai_fast.apps.cli import main

    out = tmp_path / "out"
    script = tmp_path / "job.sh"
    main(
        [
            "sbatch",
            "--gpus-per-node",
            "0",
            "--tasks-per-node",
            "2",
            "--cpus-per-task",
            "1",
            "--time",
            "00:10:00",
            "--job-name",
            "mf-gen",
            "--out",
            str(script),
            "--",
            sys.executable,
            str(TUTORIAL),
            "--tiny",
            "--data-dir",
            str(tiny_spleen),
            "--out",
            str(out),
            "--max-epochs",
            "1",
        ]
    )
    p = subprocess.run(
        ["sbatch", "--wait", str(script)], capture_output=True, text=True, timeout=300, env=slurm, cwd=tmp_path
    )
    logs = "".join(f.read_text() for f in tmp_path.glob("mf-gen-*.out"))
    assert p.returncode == 0, p.stderr + logs[-3000:]
    r0, r1 = (json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["launcher"] == "slurm" and r0["world_size"] == 2 and r0["weights_sha1"] == r1["weights_sha1"]
    assert "restart 0" in logs


BRATS = ROOT / "tutorials" / "brats_distributed.py"


def test_brats_tutorial_two_ranks_each_cache_their_share(tmp_path):
    out = tmp_path / "out"
    p = _launch(["--nproc", "2", str(BRATS), "--tiny", "--out", str(out), "--max-epochs", "2"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = (json.loads((out / f"brats_rank{i}.json").read_text()) for i in (0, 1))
    assert r0["world_size"] == 2
    assert r0["cached_items"] == r1["cached_items"] == 3  # 4 train + 2 val cases, halved
    assert r0["param_sum"] == r1["param_sum"] and r0["val_mean_dice"] == r1["val_mean_dice"]
    assert r0["cache_device"] == "cpu"


@pytest.mark.gpu
def test_brats_tutorial_caches_on_the_gpu(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, str(BRATS), "--tiny", "--out", str(out), "--max-epochs", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "brats_rank0.json").read_text())["cache_device"].startswith("cuda")
