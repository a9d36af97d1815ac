"""What a run had on, read from its record (``None`` where it does not say): the doctor advises only what applies."""

from __future__ import annotations

from dataclasses import dataclass

from monai_fast.telemetry.record import Kind, Lever, Source, select

__all__ = ["InEffect", "applied_levers", "in_effect", "latest_process", "sentence"]

_REDUCED = ("bf16", "fp16", "float16", "bfloat16")


def latest_process(rows: list[dict]) -> list[dict]:
    """The rows of the segments written by the writer of each rank's last segment (a record continued by another
    run holds that run's rows too); a record without ``segment_started`` rows is taken whole."""
    starts: dict[tuple[int, int], tuple] = {}
    for r in select(rows, Kind.EVENT, Source.RECORD):
        if r.get("what") == "segment_started":
            who = (r["writer"],) if "writer" in r else (r.get("pid"), r.get("host"))
            starts[(r.get("rank", 0), r.get("segment", 0))] = who
    last = {rank: who for (rank, _), who in sorted(starts.items())}  # each rank's latest segment's writer
    keep = {key for key, who in starts.items() if who == last[key[0]]}
    return [r for r in rows if r.get("rank", 0) not in last or (r.get("rank", 0), r.get("segment", 0)) in keep]


def applied_levers(rows: list[dict]) -> dict[str, dict]:
    """What ``FastTraining`` applied in this run, by lever: rank 0's view of the `latest_process()` rows."""
    out: dict[str, dict] = {}
    for r in select(latest_process(rows), Kind.EVENT, Source.FAST_TRAINING):
        if r.get("rank", 0) == 0 or r["lever"] not in out:
            out[r["lever"]] = r
    return out


@dataclass(frozen=True)
class InEffect:
    """What the run had on: ``None`` where the record does not say."""

    precision: str | None  #: the reduced precision the trainer ran in ("bf16", "fp16", "amp"); None: fp32 or unknown
    precision_by: str | None  #: who set it: "FastTraining", "AMPToggle", "MONAI amp=True"
    spatial_dims: int | None  #: the training network's spatial dimensions (from its convolutions)
    sliding_window: bool | None  #: whether validation ran a sliding-window inferer (False: no validation ran)
    data_cached: bool | None  #: whether the training data set is a cache
    transforms: tuple[str, ...] | None = None  #: the training chain's transform classes (None: not recorded)
    device: str | None = None  #: the trainer's device ("cpu", "cuda:0")
    cpu_bf16: bool | None = None  #: whether the trainer's CPU has bf16 instructions (None: not a CPU, or not recorded)
    windows_per_volume: float | None = None  #: sliding windows per validated batch (InferenceSplit's rows)

    @property
    def batches_windows(self) -> bool:
        """Whether a larger sliding-window batch can put more windows through the network at once: not without a
        sliding window, nor where each volume is one window (unknown counts as yes)."""
        if self.sliding_window is False:
            return False
        return self.windows_per_volume is None or self.windows_per_volume > 1


def in_effect(rows: list[dict]) -> InEffect:
    """Read `InEffect` from a run record's ``fast_training``, ``amp``, ``engine`` and ``inference`` rows."""
    engines = [r for r in select(rows, Kind.EVENT, Source.RECORD) if r.get("what") == "engine"]
    train = [r for r in engines if r.get("engine", "train") == "train"]
    others = [r for r in engines if r.get("engine", "train") != "train"]
    levers = applied_levers(rows)

    precision = by = None
    lever = levers.get(Lever.PRECISION)
    if lever is not None and lever.get("applied") and str(lever.get("setting")) in _REDUCED:
        precision, by = str(lever["setting"]), "FastTraining"
    if precision is None:
        amp = [r for r in select(rows, Kind.EPOCH, Source.AMP, engine="train") if r.get("active")]
        reduced = [r for r in amp if str(r.get("precision")) in _REDUCED]
        if reduced:
            precision, by = str(reduced[-1]["precision"]), "AMPToggle"
    # MONAI's amp=True autocasts for CUDA only: on a CPU the trainer ran in fp32 (a row without a device: as written)
    if precision is None and any(r.get("amp") and not str(r.get("device") or "cuda").startswith("cpu") for r in train):
        precision, by = "amp", "MONAI amp=True"

    dims = next((r["spatial_dims"] for r in reversed(train) if r.get("spatial_dims") is not None), None)
    windows = [r["sliding_window"] for r in others if r.get("sliding_window") is not None]
    sliding = any(windows) if windows else (False if train and not others else None)
    data = levers.get(Lever.DATA)
    cached = bool(data.get("applied")) if data is not None else None
    if not cached and any(r.get("data_cached") for r in train):
        cached = True
    elif cached is None and any("data_cached" in r for r in train):
        cached = False
    chains = [r["transforms"] for r in train if r.get("transforms") is not None]
    transforms = tuple(chains[-1]) if chains else None
    device = next((str(r["device"]) for r in reversed(train) if r.get("device") is not None), None)
    bf16 = next((bool(r["cpu_bf16"]) for r in reversed(train) if r.get("cpu_bf16") is not None), None)
    split = select(rows, Kind.EPOCH, Source.INFERENCE)
    batches = sum(r.get("iterations", 0) for r in split)
    windows = sum(r.get("windows", 0) for r in split) / batches if batches else None
    return InEffect(precision, by, dims, sliding, cached, transforms, device, bf16, windows)


def sentence(text: str) -> str:
    """``text`` as a whole sentence: with a full stop at its end unless it ends with one (or ``!``, ``?``, ``:``)."""
    text = text.rstrip()
    return text if not text or text[-1] in ".!?:" else text + "."
