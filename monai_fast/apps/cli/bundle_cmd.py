"""``monai-fast bundle run | fragment``: MONAI bundles with FastTraining. Parses, calls, prints."""

from __future__ import annotations

import argparse
import logging

from monai_fast.precision_names import REQUESTS

__all__ = ["add_bundle_command"]

_HELP = "run a MONAI bundle with FastTraining, or write the bundle config fragment"
_TEXT = "MONAI bundles with FastTraining: 'run' runs one, 'fragment' writes the config fragment a bundle can ship."
_RUN_TEXT = (
    "Run the MONAI bundle in BUNDLE_DIR as 'python -m monai.bundle run' does (--config_file, --meta_file, "
    "--logging_file; overrides as 'id=value' or '--id value'), with FastTraining attached to the config's trainer and "
    "evaluator, a run record in a folder of its own, FastTraining's decisions printed before training and the doctor's "
    "verdict at the end (docs/bundles.md). --no-fast runs the bundle as published, with the record, for a "
    "side-by-side. An override of an id the config does not have is refused unless named with --new-key ID. Parsing "
    "a config runs the code in it: run bundles you trust."
)
_NOT_ATTACHED = "FastTraining: not attached (--no-fast): the bundle as published"
_FRAGMENT_TEXT = (
    "Write the config fragment that makes MONAI's own runner attach FastTraining: merged after the bundle's train.json "
    "(python -m monai.bundle run --config_file \"['configs/train.json','configs/fast.json']\"), it appends to the "
    "bundle's initialize section an attach of a run record and FastTraining to train#trainer and validate#evaluator."
)


_RUN_HELP = {
    "--evaluator-id": "the evaluator's config id (default %(default)s; left out when the config has none)",
    "--precision": "FastTraining's precision (default auto; fp32: the engines' precision is left as built)",
    "--run-dir": "where the run record goes (default a folder of this run's own, <output_dir>/monai_fast/fast-<time> "
    "or published-<time>); a folder holding another run's record is refused",
    "--resume": "continue the record in --run-dir (a run resumed from its checkpoint) as its next segment",
    "--new-key": "an override id the config does not have, added on purpose (repeatable); without it an override "
    "of an id the config lacks (max_epoch for max_epochs) is refused, naming the nearest ids",
    "overrides": "config overrides as monai.bundle takes them: id=value or --id value "
    "(e.g. --train#trainer#max_epochs 2 dataset_dir=/data/Task09_Spleen)",
}


def _own_options(r: argparse.ArgumentParser) -> None:
    """The options of ``bundle run`` itself (the rest of the line is config overrides)."""
    config_file = "config file(s) to merge: a path or \"['configs/train.json','extra.json']\""
    for name, text in (
        ("config_file", f"{config_file} (default configs/train.json or .yaml)"),
        ("meta_file", "default configs/metadata.json when present"),
        ("logging_file", "default configs/logging.conf when present"),
    ):
        r.add_argument(f"--{name}", "--" + name.replace("_", "-"), help=text)
    r.add_argument("--no-logging-file", action="store_true", help="apply no logging file")
    r.add_argument("--trainer-id", default="train#trainer", help="the trainer's config id (default %(default)s)")
    r.add_argument("--evaluator-id", default="validate#evaluator", help=_RUN_HELP["--evaluator-id"])
    r.add_argument("--no-fast", action="store_true", help="run the bundle as published (with the run record)")
    r.add_argument("--precision", choices=REQUESTS, default="auto", help=_RUN_HELP["--precision"])
    r.add_argument("--run-dir", help=_RUN_HELP["--run-dir"])
    r.add_argument("--resume", action="store_true", help=_RUN_HELP["--resume"])
    r.add_argument("--new-key", action="append", default=[], metavar="ID", help=_RUN_HELP["--new-key"])


def _split(args: argparse.Namespace) -> argparse.Namespace:
    """Take this command's own options out of the overrides (the positional REMAINDER collects every token)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _own_options(own)
    known, rest = own.parse_known_args(args.overrides)
    for key, value in vars(known).items():
        if value != own.get_default(key):
            setattr(args, key, value)
    args.overrides = rest
    return args


def _cmd_run(args: argparse.Namespace) -> int:
    from monai_fast.bundle import BundleError, parse_overrides, run_bundle
    from monai_fast.bundle.fragment import decision_lines

    args = _split(args)
    # an engine logs the error that ends its run, then raises it: show it once, not also as ignite's log line
    logging.getLogger("ignite.engine.engine").setLevel(logging.CRITICAL)
    if args.resume and args.run_dir is None:
        raise SystemExit("monai-fast bundle run: --resume continues the record in --run-dir: name that folder")

    def show(applied: dict) -> None:
        for line in decision_lines(applied) if applied else [_NOT_ATTACHED]:
            print(line, flush=True)

    try:
        result = run_bundle(
            args.bundle_dir,
            config_files=args.config_file,
            meta_file=args.meta_file,
            logging_file=False if args.no_logging_file else args.logging_file,
            overrides=parse_overrides(args.overrides),
            fast=not args.no_fast,
            fast_options={} if args.precision == "auto" else {"precision": args.precision},
            trainer_id=args.trainer_id,
            evaluator_id=args.evaluator_id,
            run_dir=args.run_dir,
            on_applied=show,
            new_keys=args.new_key,
            resume=args.resume,
        )
    except BundleError as e:
        raise SystemExit(f"monai-fast bundle run: {e}") from e
    print(f"run record: {result.run_dir} (monai-fast doctor {result.run_dir})")
    if result.metrics:
        print("metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(result.metrics.items())))
    if result.verdict:
        print(result.verdict)
    return 0


def _cmd_fragment(args: argparse.Namespace) -> int:
    from monai_fast.bundle import write_fragment
    from monai_fast.extras import available

    path = write_fragment(args.out)
    merge = f"--config_file \"['configs/train.json','{path}']\""
    print(f"wrote {path}: merge it after the bundle's train.json with {merge}")
    if not available("fire"):  # MONAI's command line parses with fire
        print('python -m monai.bundle run needs fire, which is not installed: pip install "monai-fast[bundle]"')
    return 0


def add_bundle_command(sub: argparse._SubParsersAction) -> None:
    """Register ``monai-fast bundle`` (``run``, ``fragment``) on the command's subparsers."""
    p = sub.add_parser("bundle", help=_HELP, description=_TEXT)
    bsub = p.add_subparsers(dest="bundle_command", metavar="ACTION", required=True)
    r = bsub.add_parser("run", help="run a bundle's training with FastTraining attached", description=_RUN_TEXT)
    r.add_argument("bundle_dir", metavar="BUNDLE_DIR", help="the bundle folder (configs/ inside)")
    _own_options(r)
    r.add_argument("overrides", nargs=argparse.REMAINDER, help=_RUN_HELP["overrides"])
    r.set_defaults(func=_cmd_run)
    f = bsub.add_parser("fragment", help="write the config fragment a bundle can ship", description=_FRAGMENT_TEXT)
    f.add_argument("--out", default="configs/fast.json", help="where to write it (default %(default)s)")
    f.set_defaults(func=_cmd_fragment, computes=False)
