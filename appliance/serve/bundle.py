"""The serve program as one file: a zip application of the modules it runs, for the host's
``/usr/bin/python3`` (``python -m zipapp``'s format: a shebang line, then a zip).

``appliance instance install`` writes it to ``/usr/local/libexec/gemma4-vllm/serve``. It holds the
appliance modules the serve program imports, all standard library only, and ``packaging`` (for
version comparisons), so the host needs no package of the appliance's. The bytes depend only on
those sources: an unchanged appliance writes an identical file (``install`` stays idempotent and
a fleet rollout restarts nothing).
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import packaging

INTERPRETER = "/usr/bin/python3"
# -I: no PYTHONPATH or user site from the unit's environment; -S: no site-packages at all.
SHEBANG = f"#!{INTERPRETER} -IS\n"
_APPLIANCE = Path(__file__).resolve().parents[1]
# The serve program's imports, each a module of the appliance (a test runs the bundle with
# nothing else importable, so a missing one fails there, not on a host).
MODULES = (
    "__init__.py",
    "errors.py",
    "fsutil.py",
    "progress.py",
    "engine_api/__init__.py",
    "engine_api/shed.py",
    "engine_api/versions.py",
    "host/__init__.py",
    "host/apikey.py",
    "host/cdi.py",
    "host/envfile.py",
    "host/names.py",
    "host/layout.py",
    "host/lock.py",
    "host/values.py",
    "models/__init__.py",
    "models/cache.py",
    "models/token.py",
    "models/verify.py",
    "oci/__init__.py",
    "oci/imageref.py",
    "oci/labels.py",
    "serve/__init__.py",
    "serve/argsfile.py",
    "serve/container.py",
    "serve/docker.py",
    "serve/environment.py",
    "serve/health.py",
    "serve/main.py",
)
MAIN = "import sys\nfrom appliance.serve.main import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same bytes on every build


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(info, data)


def build() -> bytes:
    """The serve program's bytes."""
    buf = io.BytesIO()
    buf.write(SHEBANG.encode())
    with zipfile.ZipFile(buf, "w") as zf:
        _add(zf, "__main__.py", MAIN.encode())
        for rel in MODULES:
            _add(zf, f"appliance/{rel}", (_APPLIANCE / rel).read_bytes())
        vendored = Path(packaging.__file__).parent
        for path in sorted(vendored.rglob("*.py")):
            _add(zf, f"packaging/{path.relative_to(vendored).as_posix()}", path.read_bytes())
    return buf.getvalue()
