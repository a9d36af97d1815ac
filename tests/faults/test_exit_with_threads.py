"""A run that ends while a background thread is inside torch code exits cleanly, with its own exit code.

A daemon thread still running torch's C++ code at interpreter exit aborts the process ("terminate
called without an active exception", SIGABRT): a rank stopped for preemption under torchrun
failed the job that way while its loader thread made the next batch. Each thread monai-fast starts
(loader, cache fill, SmartCache replacement) is stopped before the interpreter tears down. The
scripts below end their process while such a thread is busy in a slow torch transform.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# a transform that keeps torch busy for 1 s on any CPU, in C++ most of the time
_PRELUDE = textwrap.dedent(
    """
    import sys, time
    import torch
    from monai.transforms import Lambda

    def busy(x):
        v, start = torch.rand(48, 48, 48), time.monotonic()
        while time.monotonic() - start < 1.0:
            v = torch.nn.functional.interpolate(v[None, None], scale_factor=1.2, mode="trilinear")[0, 0, :48, :48, :48]
        return {"img": v + x["i"]}

    data = [{"i": i} for i in range(8)]
    chain = Lambda(busy)
    """
)

_SCRIPTS = {
    "loader thread of an iteration left open": """
        from monai.data import Dataset
        from monai_fast.data.loaders import SafeThreadDataLoader

        loader = SafeThreadDataLoader(Dataset(data, chain), batch_size=1, prefetch=True)
        batches = iter(loader)  # held to the end, as an engine or a notebook variable holds it
        next(batches)
        time.sleep(0.3)  # the training step, while the loader thread makes the next batch
        sys.exit(3)
    """,
    "background cache fill": """
        from monai_fast.data.background import BackgroundCacheDataset

        ds = BackgroundCacheDataset(data, chain, num_workers=1, progress=False)
        time.sleep(0.2)
        sys.exit(3)  # while the fill thread caches an item
    """,
    "SmartCache replacement": """
        from monai_fast.data.smartcache import SafeSmartCacheDataset

        ds = SafeSmartCacheDataset(data, chain, replace_rate=0.5, cache_num=2, num_init_workers=1, progress=False)
        ds.start()  # prepares the next items in its thread
        time.sleep(0.2)
        sys.exit(3)
    """,
}


@pytest.mark.parametrize("case", sorted(_SCRIPTS))
def test_the_process_ends_with_its_own_exit_code(case, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_PRELUDE + textwrap.dedent(_SCRIPTS[case]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]  # without the stop: on every run
    assert done.returncode == 3, done.stderr[-2000:]


def test_an_object_without_a_stop_is_refused():
    from monai_fast.threads import stop_at_exit

    with pytest.raises(TypeError, match="stop_for_exit"):
        stop_at_exit(object())


def test_one_failing_stop_does_not_keep_the_others_running(tmp_path):
    # in a process of its own: the exit hook is the process's, and stopping here would stop other tests' threads
    script = tmp_path / "hook.py"
    script.write_text(
        textwrap.dedent(
            """
            import logging, sys, threading
            from monai_fast.threads import stop_at_exit

            logging.basicConfig(level=logging.INFO)

            class Failing:
                def stop_for_exit(self):
                    raise RuntimeError("boom")

            class Waiting:
                def __init__(self):
                    self.halt = threading.Event()
                    self.thread = threading.Thread(target=self.halt.wait, daemon=True)
                    self.thread.start()

                def stop_for_exit(self):
                    self.halt.set()
                    self.thread.join(5)
                    print("stopped", not self.thread.is_alive(), flush=True)

            failing, waiting = Failing(), Waiting()
            stop_at_exit(waiting)
            stop_at_exit(failing)
            sys.exit(3)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "stopped True" in done.stdout and "Failing's threads at exit failed" in done.stderr, done.stderr
