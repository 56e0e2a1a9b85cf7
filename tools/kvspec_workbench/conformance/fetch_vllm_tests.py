"""Fetch a vLLM sdist from PyPI and unpack only its ``tests/`` tree.

``pip download --no-binary :all: vllm==X`` builds the sdist's metadata, which on a CPU
machine reads ``X+cpu`` and is then discarded as not matching; so the file is fetched
itself, its URL and sha256 taken from the index's JSON simple API (PEP 691).

Usage: fetch_vllm_tests.py VERSION CACHE_DIR DEST_DIR
  keeps vllm-VERSION.tar.gz in CACHE_DIR (a fresh clone reuses it) and writes
  DEST_DIR/tests/... (atomically: DEST_DIR appears only when complete).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

INDEX = os.environ.get("KVSPEC_PYPI_SIMPLE", "https://pypi.org/simple")


def sdist_url(version: str) -> tuple[str, str]:
    request = urllib.request.Request(
        f"{INDEX}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return str(entry["url"]), str(entry["hashes"]["sha256"])
    raise SystemExit(f"{name} is not on {INDEX}/vllm/")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    version, cache, dest = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"vllm-{version}.tar.gz"
    if not tarball.exists():
        url, expected = sdist_url(version)
        partial = tarball.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f)
        if sha256(partial) != expected:
            partial.unlink()
            raise SystemExit(f"{url}: sha256 differs from the index's {expected}")
        partial.rename(tarball)
    top = f"vllm-{version}/tests/"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(top) and (member.isfile() or member.isdir()):
                member.name = member.name[len(f"vllm-{version}/") :]
                members.append(member)
        if not members:
            raise SystemExit(f"{tarball} has no {top}")
        tar.extractall(tmp, members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"vLLM {version} tests: {len(members)} entries in {dest}")


if __name__ == "__main__":
    main()
