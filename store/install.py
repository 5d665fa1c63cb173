"""How to install an extra into this installation: the command a missing-extra error names.

``staging-store`` is not on PyPI yet, so installing an extra by the package's name cannot work.  An
installation from a checkout (``make demo``, ``pip install -e .``) names that checkout, with the
interpreter that runs this code, so the line installs into the right environment; any other
installation (a built wheel) names the extra's packages, read from its own metadata.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from importlib import metadata
from urllib.parse import unquote, urlparse

DISTRIBUTION = "staging-store"
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([\w.-]+)["']""")


def version() -> str:
    """This installation's version ("unknown" when it runs from a folder that was never installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def extra_hint(extra: str) -> str:
    """The command that installs ``extra`` (``http``, ``postgres``, ``transformers``) here."""
    python = shlex.quote(sys.executable)
    # Every copy of the metadata on sys.path: a checkout's own egg-info (found first when Python
    # runs from the checkout) has no record of the install, the installed copy does.
    found = list(metadata.distributions(name=DISTRIBUTION))
    if not found:
        return f"{python} -m pip install -e '.[{extra}]' in the staging-store checkout"
    for copy in found:
        checkout = _checkout(copy)
        if checkout is not None:
            folder, editable = checkout
            return f"{python} -m pip install {'-e ' if editable else ''}{shlex.quote(f'{folder}[{extra}]')}"
    packages = extra_requirements(found[0].requires or [], extra)
    if not packages:
        return f"install the [{extra}] extra of staging-store"
    return f"{python} -m pip install {' '.join(shlex.quote(package) for package in packages)}"


def extra_requirements(requires: list[str], extra: str) -> list[str]:
    """The requirements an extra adds (``fastapi>=0.110``, ...), from a distribution's ``Requires-Dist``."""
    packages = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        match = _EXTRA_MARKER.search(marker)
        if match is not None and match[1] == extra and not requirement.strip().startswith(DISTRIBUTION):
            packages.append(requirement.strip())
    return packages


def _checkout(found: metadata.Distribution) -> tuple[str, bool] | None:
    """The folder this was installed from and whether editably, when it was a local folder (PEP 610)."""
    text = found.read_text("direct_url.json")
    if not text:
        return None
    try:
        origin = json.loads(text)
    except ValueError:
        return None
    url = origin.get("url", "")
    if not isinstance(url, str) or not url.startswith("file://") or "dir_info" not in origin:
        return None
    return unquote(urlparse(url).path), bool(origin["dir_info"].get("editable"))
