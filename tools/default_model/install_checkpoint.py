"""Installs the checkpoint of a GPU training run (tools/gpu/train_default_model.sh) as the embedded model.

    python -m tools.default_model.install_checkpoint FILES_AT [--cpu-eval REPORT.json] [--dry-run]

FILES_AT is the folder the device tool copied $OUT into (ckpt.tar.part00, part01, ..., results.json). The
parts are joined and unpacked; the checkpoint is checked (loads, same architecture and tokenizer as the
shipped model, within the size budget) and then copied into worker/assets/default_model/ with its training
log and record; results.json goes to tools/default_model/results/gpu_train_results.json and the model
card's `gpu-run` figures are rewritten from it. With --cpu-eval (the report of
`python -m tools.default_model.evaluate --out REPORT.json`, run after installing) the card's `cpu-eval`
figures are rewritten too.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from . import REPO_ROOT, model_card

ASSETS = REPO_ROOT / "worker/assets/default_model"
RESULTS_COPY = REPO_ROOT / "tools/default_model/results/gpu_train_results.json"
MAX_DIR_BYTES = 32_000_000
MODEL_FILES = ("model.safetensors", "config.json", "generation_config.json")
RECORDS = {"train_log.tsv": "training_log.tsv", "train_results.json": "training_results.json"}


class InstallError(RuntimeError):
    pass


def unpack(files_at: Path, into: Path) -> Path:
    """Join `ckpt.tar.part*` in order and unpack; returns the folder holding ckpt/ and the records."""
    parts = sorted(files_at.glob("ckpt.tar.part*"))
    if not parts:
        raise InstallError(f"{files_at}: no ckpt.tar.part* files (did the GPU run write a checkpoint?)")
    data = b"".join(p.read_bytes() for p in parts)
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(into, filter="data")
    except tarfile.TarError as e:
        raise InstallError(f"{files_at}: the joined parts are not a whole tar archive ({e})") from e
    for name in (*(f"ckpt/{n}" for n in MODEL_FILES), *RECORDS, "results.json"):
        if not (into / name).is_file():
            raise InstallError(f"{files_at}: the archive lacks {name}")
    return into


def check_checkpoint(ckpt: Path, assets: Path) -> None:
    """Same config and tokenizer as the shipped model, loads with our loader, fits the size budget."""
    from onestream.worker.loading import load_model

    shipped, new = (json.loads((d / "config.json").read_text()) for d in (assets, ckpt))
    if shipped != new:
        changed = sorted(k for k in shipped.keys() | new.keys() if shipped.get(k) != new.get(k))
        raise InstallError(f"the new checkpoint's config.json differs from the shipped model's in {changed}")
    if (ckpt / "tokenizer.json").read_bytes() != (assets / "tokenizer.json").read_bytes():
        raise InstallError(
            "the new checkpoint's tokenizer.json differs from the shipped one (the data was made with it)"
        )
    load_model(ckpt)
    size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
    if size > MAX_DIR_BYTES:
        raise InstallError(f"the new checkpoint has {size} bytes, over the {MAX_DIR_BYTES}-byte budget")


def install(
    files_at: Path,
    assets: Path,
    *,
    results_copy: Path = RESULTS_COPY,
    cpu_eval: Path | None = None,
    dry_run: bool = False,
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = unpack(files_at, Path(tmp))
        check_checkpoint(unpacked / "ckpt", assets)
        results = json.loads((unpacked / "results.json").read_text())
        card = (assets / "README.md").read_text()
        card = model_card.replace_block(card, "gpu-run", model_card.gpu_run_block(results))
        if cpu_eval is not None:
            card = model_card.replace_block(
                card, "cpu-eval", model_card.cpu_eval_block(json.loads(cpu_eval.read_text()))
            )
        if dry_run:
            print(card)
            return results
        for name in MODEL_FILES:
            shutil.copyfile(unpacked / "ckpt" / name, assets / name)
        for source, target in RECORDS.items():
            shutil.copyfile(unpacked / source, assets / target)
        shutil.copyfile(unpacked / "results.json", results_copy)
        (assets / "README.md").write_text(card)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files_at", type=Path, help="the folder holding ckpt.tar.part* and results.json")
    parser.add_argument("--assets", type=Path, default=ASSETS)
    parser.add_argument("--cpu-eval", type=Path, help="tools/default_model/evaluate.py's JSON report")
    parser.add_argument("--dry-run", action="store_true", help="check and print the new card; change nothing")
    args = parser.parse_args(argv)
    try:
        results = install(args.files_at, args.assets, cpu_eval=args.cpu_eval, dry_run=args.dry_run)
    except (InstallError, model_card.MissingMarkersError) as e:
        raise SystemExit(f"install_checkpoint: {e}") from e
    heldout = results["training"]["heldout"]
    print(
        f"{'checked' if args.dry_run else 'installed'}: {results['training']['steps']} steps, held-out loss "
        f"{heldout['loss']:.3f} (ppl {heldout['perplexity']:.2f})"
    )
    if not args.dry_run and args.cpu_eval is None:
        print(
            "next: python -m tools.default_model.evaluate --threads 1 --heldout-windows 4 --out /tmp/cpu_eval.json"
            f" && python -m tools.default_model.install_checkpoint {args.files_at} --cpu-eval /tmp/cpu_eval.json"
        )


if __name__ == "__main__":
    main()
