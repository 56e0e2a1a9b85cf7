"""Fetch a pinned vllm-ascend source distribution from PyPI and unpack its Python tree.

vllm-ascend's sdist cannot be installed here: building its metadata runs its CMake build,
which needs the Ascend NPU toolchain (CANN). So the file is fetched itself, from the
index's JSON simple API (PEP 691), checked against the sha256 pinned below, and only the
``vllm_ascend/`` package's ``.py`` files are unpacked (nothing is built or installed).

Usage: fetch_vllm_ascend.py VERSION CACHE_DIR DEST_DIR
  keeps vllm_ascend-VERSION.tar.gz in CACHE_DIR (a fresh clone reuses it) and writes
  DEST_DIR/vllm_ascend/... (atomically: DEST_DIR appears only when complete).
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

# The sources the adapter package examples/kvspec_traits_ascend is checked against:
# the release (AscendMLAAttentionSpec, AscendSlidingWindowMLASpec; built from commit
# 1cdb8c4db, its vllm_ascend/_version.py says) and the first later sdist that adds
# AscendSFAIndexerCacheSpec (commit 3b3188623). A version not listed here is refused.
PINNED = {
    "0.23.0.post1": "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
    "0.27.1rc1": "6fa8b357b624df4c8810c445da24082a9147009d8fe1db33eff815c8ab9805f0",
}


def sdist_url(version: str) -> str:
    request = urllib.request.Request(
        f"{INDEX}/vllm-ascend/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    name = f"vllm_ascend-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return str(entry["url"])
    raise SystemExit(f"{name} is not on {INDEX}/vllm-ascend/")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main() -> None:
    version, cache, dest = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    if version not in PINNED:
        raise SystemExit(f"vllm-ascend {version} is not pinned in {__file__}")
    expected = PINNED[version]
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"vllm_ascend-{version}.tar.gz"
    if not tarball.exists():
        url = sdist_url(version)
        partial = tarball.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as f:
            shutil.copyfileobj(response, f)
        partial.rename(tarball)
    if sha256(tarball) != expected:
        tarball.unlink()
        raise SystemExit(f"{tarball}: sha256 differs from the pinned {expected}; removed")
    top = f"vllm_ascend-{version}/"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            name = member.name[len(top) :] if member.name.startswith(top) else ""
            if name.startswith("vllm_ascend/") and (
                member.isdir() or (member.isfile() and name.endswith(".py"))
            ):
                member.name = name
                members.append(member)
        if not members:
            raise SystemExit(f"{tarball} has no {top}vllm_ascend/")
        tar.extractall(tmp, members, filter="data")
    (tmp / "SHA256").write_text(f"{expected}  {tarball.name}\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    print(f"vllm-ascend {version}: {len(members)} entries in {dest}")


if __name__ == "__main__":
    main()
