"""A disk cache must never serve items made by other code: a ``Lambdad`` whose body, closure or
defaults change gets new keys, across real processes (the way a user edits a script and reruns)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    from monai.transforms import Compose, EnsureChannelFirstd, Lambdad, LoadImaged
    from monai_fast.data.persistent import TrustedPersistentDataset

    image, label, cache = sys.argv[1:4]
    OFFSET = {offset}
    scale = {scale}
    def shift(x, extra={extra}):
        return x * scale + OFFSET + extra
    chain = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
                     Lambdad(keys="image", func={func})])
    item = TrustedPersistentDataset([{{"image": image, "label": label}}], chain, cache)[0]
    print(float(torch.as_tensor(item["image"]).float().mean()))
""")


def _run(case, cache, func="shift", offset=0, scale=1, extra=0):
    code = SCRIPT.format(func=func, offset=offset, scale=scale, extra=extra)
    out = subprocess.run(
        [sys.executable, "-c", code, case["image"], case["label"], str(cache)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip().splitlines()[-1]), out.stderr


def _in_process(case, cache, func="shift", offset=0, scale=1, extra=0):
    """The same script, run in this process as a fresh module (as a re-run notebook cell would)."""
    import contextlib
    import io

    code = SCRIPT.format(func=func, offset=offset, scale=scale, extra=extra)
    buf = io.StringIO()
    argv = sys.argv
    sys.argv = ["script", case["image"], case["label"], str(cache)]
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<user script>", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    return float(buf.getvalue().strip().splitlines()[-1])


def test_the_same_code_is_served_from_the_cache_across_processes(tiny_files, tmp_path):
    case = tiny_files[0][0]
    cache = tmp_path / "cache"
    base, _ = _run(case, cache)
    stamps = {p: p.stat().st_mtime_ns for p in cache.glob("*.pt")}
    again, _ = _run(case, cache)
    assert again == base and len(stamps) == 1
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.pt")} == stamps, "a hit must not rewrite the file"


@pytest.mark.parametrize(
    "change",
    [{"func": "lambda x: x * 2"}, {"scale": 3}, {"offset": 1000}, {"extra": 7}],
    ids=["lambda body", "closure/global value", "module constant", "default argument"],
)
def test_a_changed_function_is_recomputed_not_served_stale(tiny_files, tmp_path, change):
    case = tiny_files[0][0]
    cache = tmp_path / "cache"
    base = _in_process(case, cache)
    assert _in_process(case, cache) == base
    changed = _in_process(case, cache, **change)
    assert changed != pytest.approx(base), f"stale cached items served after changing {change}"
    assert len(list(cache.glob("*.pt"))) == 2


def test_an_unreadable_callable_is_not_trusted_and_says_so(tiny_files, tmp_path):
    from monai.transforms import Lambdad

    from monai_fast.data.persistent import transform_fingerprint

    class Opaque:
        __slots__ = ()

        def __call__(self, x):
            return x

    fp = transform_fingerprint([Lambdad("image", Opaque())])
    assert fp.untrusted == [f"{Opaque.__module__}.{Opaque.__qualname__}"]
    assert transform_fingerprint([Lambdad("image", str.upper)]).untrusted == []  # builtins are known by name
    case = tiny_files[0][0]
    from monai.transforms import Compose, LoadImaged

    from monai_fast.data.persistent import TrustedPersistentDataset

    chain = Compose([LoadImaged(keys=["image", "label"]), Lambdad("image", Opaque())])
    first = TrustedPersistentDataset([case], chain, tmp_path / "c")
    second = TrustedPersistentDataset([case], chain, tmp_path / "c")
    assert not first.trusted and first.transform_hash != second.transform_hash  # never reused across runs
