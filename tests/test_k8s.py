"""``monai-fast k8s``: the rendered PyTorchJob parses as YAML, has the operator's structure, and its pods'
command, run by a real shell with the operator's variables, is a ``monai-fast launch`` that launch accepts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from monai_fast.apps.cli import build_parser, main
from monai_fast.apps.cli.tools import _launch_spec
from monai_fast.apps.launch.jobs import PyTorchJobSpec, pytorchjob, render_pytorchjob

yaml = pytest.importorskip("yaml")  # PyYAML reads the manifest in the test; rendering does not need it

SCRIPT = ["train.py", "--checkpoint-dir", "/workspace/run/ckpt", "--note", 'it\'s a "test"']


def _manifest(**kw) -> dict:
    spec = PyTorchJobSpec(SCRIPT, image="reg.io/me/monai-fast:1.0", **kw)
    doc = yaml.safe_load(render_pytorchjob(spec))
    assert doc == pytorchjob(spec)  # the YAML says exactly what was built
    return doc


def test_manifest_is_a_pytorchjob_with_one_master_and_the_other_nodes_as_workers():
    doc = _manifest(nodes=3, gpus_per_node=4, memory="64Gi", volume_claim="runs", namespace="ml", job_name="spleen")
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["metadata"] == {"name": "spleen", "namespace": "ml"}
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    for role in replicas.values():
        assert role["restartPolicy"] == "OnFailure"
        pod = role["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "reg.io/me/monai-fast:1.0"
        assert c["resources"]["limits"] == {"cpu": 8, "memory": "64Gi", "nvidia.com/gpu": 4}
        assert "nvidia.com/gpu" not in c["resources"]["requests"]
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/dev/shm", "/workspace/run"}
        assert {"name": "run", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
        assert pod["terminationGracePeriodSeconds"] > 120  # longer than the ranks' --grace-s
        assert c["command"] == ["/bin/sh", "-c"] and c["args"][0].startswith(
            "exec monai-fast launch --nnodes 3 --nproc 4 "
        )
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 3


def test_one_node_cpu_job_has_no_workers_and_no_gpus():
    doc = _manifest(nodes=1, gpus_per_node=0, procs_per_node=3)
    assert set(doc["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    c = doc["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"] and "--nnodes 1 --nproc 3 " in c["args"][0]


def test_the_pods_command_under_a_shell_is_a_launch_that_launch_accepts(tmp_path, monkeypatch):
    """Run the container's command line with ``sh -c`` and the variables the operator sets, a stand-in
    ``monai-fast`` on PATH printing its arguments; parse them as ``monai-fast`` would."""
    fake = tmp_path / "bin" / "monai-fast"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    c = _manifest(nodes=2, gpus_per_node=2)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
        0
    ]
    env = {
        **os.environ,
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "RANK": "1",
        "MASTER_ADDR": "spleen-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "2",
    }
    p = subprocess.run([*c["command"], *c["args"]], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    argv = json.loads(p.stdout)
    assert argv == [
        "launch",
        "--nnodes",
        "2",
        "--nproc",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "spleen-master-0",
        "--master-port",
        "23456",
        "--grace-s",
        "120",
        *SCRIPT,
    ]
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    spec = _launch_spec(build_parser().parse_args(argv))
    assert (spec.form, spec.nnodes, spec.node_rank, spec.master_port) == ("static", 2, 1, 23456)


def test_cli_writes_the_manifest(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert main(["k8s", "--image", "me/mf:1", "--nodes", "2", "--out", str(out), "--", *SCRIPT]) == 0
    assert f"kubectl apply -f {out}" in capsys.readouterr().out
    assert yaml.safe_load(out.read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1


def test_cli_names_every_bad_option():
    with pytest.raises(SystemExit) as e:
        main(
            [
                "k8s",
                "--image",
                "me/mf:1",
                "--nodes",
                "0",
                "--job-name",
                "Spleen_Job",
                "--memory",
                "64GB",
                "--",
                "python",
                "train.py",
            ]
        )
    message = str(e.value)
    assert message.startswith("monai-fast k8s: ") and message.count("monai-fast k8s:") == 1
    for named in ("nodes must be >= 1", "job_name 'Spleen_Job'", "memory '64GB'", "without 'python'"):
        assert named in message, (named, message)


def test_the_monai_fast_command_as_the_script_is_refused_naming_the_module_form():
    with pytest.raises(SystemExit) as e:
        main(["k8s", "--image", "me/mf:1", "--", "monai-fast", "train", "--checkpoint-dir", "/ckpt/x"])
    message = str(e.value)
    assert "give -m monai_fast train instead of 'monai-fast'" in message, message
