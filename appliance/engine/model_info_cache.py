"""vLLM's model-info cache for the Gemma 4 architectures: made when an image is built
(:func:`bake`), put where vLLM looks for it at each start (:func:`seed`, from vllm_main.py).

Before it builds an engine, vLLM asks what the model's class is (multimodal, MTP, pooling...)
in a fresh Python process, so that the parent never initialises CUDA: ``_LazyRegisteredModel.
inspect_model_cls`` and ``_run_in_subprocess`` in ``vllm/model_executor/models/registry.py``. That
process imports vLLM again, 7 s of CPU for each of a target and its MTP drafter on a 2-core host
(the tiny CPU engine's start: 26.5 s of CPU cold, 12.2 s with the answers cached), unless
``$VLLM_CACHE_ROOT/modelinfos/<module>-<class>.json`` holds the answer for the module file's
current hash. A container started without a cache mount asks at every start, and two images of
different vLLM releases sharing one cache directory overwrite each other's answer (one file name,
two hashes), so each asks again after the other has run.

So the image's build asks once, through vLLM's own code, and keeps the answers beside the entry
point; each start copies them into the cache where they are missing or different. vLLM still
checks each answer against its module's hash: a stale one costs the inspection it would have
saved, nothing more (gotchas/vllm-model-info-subprocess.md).

Copied into the images beside vllm_main.py: standard library only at import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

# The image's answers, beside this file (/opt/gemma4-appliance/modelinfos).
BAKED = Path(__file__).with_name("modelinfos")
# vLLM's folder for them under its cache root (registry.py, _get_cache_dir).
FOLDER = "modelinfos"
# The architectures the appliance serves: targets, their multimodal and unified forms, drafters.
PREFIX = "Gemma4"


def bake(dest: Path) -> tuple[list[str], dict[str, str]]:
    """Ask vLLM about every Gemma 4 architecture it registers, through its own cached
    inspection, and keep its answers in ``dest`` (replaced). Returns the files written and the
    architectures that could not be inspected (architecture -> the last line of why).

    Run in a fresh process: vLLM reads ``VLLM_CACHE_ROOT`` when it first needs it."""
    root = Path(tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ["VLLM_CACHE_ROOT"] = str(root)
    from vllm.model_executor.models import registry

    # vLLM asks in a process of its own to keep CUDA out of the server's process; a build has
    # no accelerator to keep clean and this process ends after the bake. Asked here, the five
    # classes took 17 s instead of 89 (each process imports vLLM again). vLLM still hashes the
    # modules and writes the answers. Where a release renames the function, it asks as before.
    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = lambda fn: fn()
    models = registry.ModelRegistry

    failed: dict[str, str] = {}
    for arch in sorted(a for a in models.get_supported_archs() if a.startswith(PREFIX)):
        try:
            models.models[arch].inspect_model_cls()
        except Exception as exc:  # noqa: BLE001 - one architecture's failure is reported, not fatal
            # A subprocess's failure brings its traceback whole: its last line says why.
            failed[arch] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
    answers = root / FOLDER
    answers.mkdir(exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(answers, dest)
    shutil.rmtree(root, ignore_errors=True)
    return sorted(p.name for p in dest.glob("*.json")), failed


def seed(cache_root: Path, baked: Path | None = None) -> list[str]:
    """Copy each of ``baked``'s answers (default :data:`BAKED`) into ``cache_root/modelinfos``
    where it is missing or differs (each file replaced whole, atomically). Returns the names
    written; none when there is no such folder (the entry point run from the package)."""
    baked = BAKED if baked is None else baked
    if not baked.is_dir():
        return []
    folder = cache_root / FOLDER
    written = []
    for src in sorted(baked.glob("*.json")):
        data = src.read_bytes()
        dst = folder / src.name
        with contextlib.suppress(OSError):
            if dst.read_bytes() == data:
                continue
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{src.name}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        written.append(src.name)
    return written


def main(argv: list[str]) -> int:
    """``python3 model_info_cache.py DEST``: :func:`bake` into ``DEST`` (an image's build)."""
    if len(argv) != 1:
        print("usage: model_info_cache.py DEST", file=sys.stderr)
        return 2
    written, failed = bake(Path(argv[0]))
    for arch, why in failed.items():
        print(f"model info of {arch} not kept (vLLM inspects it at each start): {why}")
    print(f"model infos kept in {argv[0]}: {', '.join(written) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
