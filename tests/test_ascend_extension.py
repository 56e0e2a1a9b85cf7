"""The vendor extension examples/kvspec_traits_ascend on vllm-ascend's own spec classes.

vllm-ascend's classes come from its pinned sdists (scripts/fetch_vllm_ascend.py, run by
scripts/bootstrap.sh): the 0.23.0.post1 release and 0.27.1rc1, the first later sdist that
adds AscendSFAIndexerCacheSpec. They are checked on the vLLM 0.34 modules only (the issue's
series; on 0.32 and 0.33 the same tests pass when run by hand, so they are skipped there
to save each pass ~2 min). Each tree is imported in a
child process (tests/ascend_probe.py, and ``kvspec-traits report`` as a user runs it), so
no Ascend class joins this process's class tree. Every expected byte count is computed
by hand below from vllm-ascend's formulas in ``vllm_ascend/core/kv_cache_interface.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm

from kvspec_traits._deps import vllm_series
from tests import fresh

REPO = Path(__file__).resolve().parents[1]
RELEASE = REPO / ".cache" / "vllm-ascend-0.23.0.post1"
NEWER = REPO / ".cache" / "vllm-ascend-0.27.1rc1"
PACKAGE = REPO / "examples" / "kvspec_traits_ascend"

pytestmark = pytest.mark.skipif(
    vllm_series(vllm.__version__) != "0.34",
    reason="vllm-ascend's spec classes are checked once, on the vLLM 0.34 modules (issue 39): "
    "the same tests pass on 0.32 and 0.33 (run by hand), and a pass costs ~2 min",
)


def _tree(path: Path) -> Path:
    if not (path / "vllm_ascend" / "core" / "kv_cache_interface.py").is_file():
        pytest.fail(f"{path} is missing: scripts/bootstrap.sh fetches vllm-ascend's pinned sdists")
    return path


@pytest.mark.parametrize(
    ("tree", "sha256", "commit"),
    [
        (RELEASE, "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1", "1cdb8c4db"),
        (NEWER, "6fa8b357b624df4c8810c445da24082a9147009d8fe1db33eff815c8ab9805f0", "3b3188623"),
    ],
    ids=["0.23.0.post1", "0.27.1rc1"],
)
def test_the_trees_are_the_pinned_sdists(tree: Path, sha256: str, commit: str) -> None:
    """What the fetch checked (the sdist's sha256) and the commit the sdist was built from."""
    assert (_tree(tree) / "SHA256").read_text().split()[0] == sha256
    version = (tree / "vllm_ascend" / "_version.py").read_text()
    assert f"commit_id = 'g{commit}'" in version


def _env(*first: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, first), *sys.path])
    return env


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as pip installs it (its entry point in a dist-info), in a folder of its
    own: the shared environment is left alone."""
    target = tmp_path_factory.mktemp("ascend-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
         "--no-deps", "--no-build-isolation", "--target", str(target), str(PACKAGE)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def _probe(tree: Path, device: str | None = None) -> dict[str, Any]:
    env = _env(_tree(tree), PACKAGE / "src")
    env.pop("KVSPEC_ASCEND_DEVICE", None)
    if device is not None:
        env["KVSPEC_ASCEND_DEVICE"] = device
    done = fresh.run(
        [sys.executable, str(REPO / "tests" / "ascend_probe.py")], env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def release() -> dict[str, Any]:
    return _probe(RELEASE)


@pytest.fixture(scope="module")
def newer() -> dict[str, Any]:
    return _probe(NEWER)


def _pages(rows: list[dict[str, Any]]) -> list[tuple[str, int, int, int, int]]:
    return [
        (
            r["class"],
            r["page_size_bytes"],
            r["real_page_size_bytes"],
            r["traits"]["page_size_bytes"],
            r["traits"]["unpadded_page_size_bytes"],
        )
        for r in rows
    ]


def test_without_the_adapter_the_release_classes_are_refused(release: dict[str, Any]) -> None:
    assert release["classes"] == ["AscendMLAAttentionSpec", "AscendSlidingWindowMLASpec"]
    assert release["without_adapter"]["error"] == "UnsupportedSpecError"


def test_the_device_query_stand_in_decides_the_c8_defaults(release: dict[str, Any]) -> None:
    """Off an NPU the one device query is answered by KVSPEC_ASCEND_DEVICE (default A3):
    vllm-ascend's own defaults follow, int8/float16 there and float8/float32 on A5."""
    assert release["c8_defaults"] == ["torch.int8", "torch.float16"]
    assert _probe(RELEASE, device="A5")["c8_defaults"] == ["torch.float8_e4m3fn", "torch.float32"]
    # 0.27.1rc1's spec module no longer asks (no such fields): nothing is stood in for
    assert _probe(NEWER, device="no-such-chip")["c8_defaults"] == ["None", "None"]


def test_release_representatives_match_vllm_ascend_page_math(release: dict[str, Any]) -> None:
    mla, swa = "AscendMLAAttentionSpec", "AscendSlidingWindowMLASpec"
    # MLA: block 128 x 1 head x (head_size x dtype bytes); DSA: head_size = sum(sparse_head_dim)
    # SWA-MLA: storage_block_size (= block_size in 0.23.0.post1) x head_size x dtype,
    # padded to DSV4_BLOCK_SIZES[128][1] (16640 or 131072) for the compressor states.
    assert _pages(release["representatives"]) == [
        (mla, 128 * 576 * 2, 147456, 147456, 147456),
        (mla, 128 * 576 * 1, 73728, 73728, 73728),
        (mla, 128 * (512 + 64 + 128) * 2, 180224, 180224, 180224),
        (mla, 128 * (512 + 64) * 2, 147456, 147456, 147456),
        (swa, 128 * 512 * 2, 131072, 131072, 131072),
        (swa, 131072, 8 * 2048 * 4, 131072, 65536),
        (swa, 16640, 8 * 512 * 4, 16640, 16384),
        (swa, 131072, 32 * 1024 * 4, 131072, 131072),
    ]
    for row in release["representatives"]:
        t = row["traits"]
        assert (t["is_mla"], t["tp_layout"]) == (True, "replicated")
        if row["class"] == swa:
            assert t["token_scope"] == "sliding_window"
            assert t["states_per_block"] == row["storage_block_size"]
    dsa = release["representatives"][2]["traits"]["components"]
    assert dsa == [
        ["kv_lora", [1, 128, 512], "bfloat16", 128 * 512 * 2],
        ["k_rope", [1, 128, 64], "bfloat16", 128 * 64 * 2],
        ["indexer_k", [1, 128, 128], "bfloat16", 128 * 128 * 2],
    ]


def test_pages_vllm_ascend_counts_two_ways_are_refused(release: dict[str, Any]) -> None:
    """C8 and the DCP-replicated indexer: AscendMLAAttentionSpec overrides page_size_bytes
    but inherits real_page_size_bytes from AttentionSpec (heads x block x head_size x
    dtype), so the class states two page sizes; kvspec-traits names the inherited one."""
    cases = release["cases"]
    expected = {
        # 128 x ((512 + 64) x 2 + 128 x int8 + 1 x float16) vs 128 x 704 x 2
        "dsa_li_c8": (128 * ((512 + 64) * 2 + 128 * 1 + 2), 128 * 704 * 2),
        # 128 x (512 + 64 + 2 x 128) x 2 vs 128 x 704 x 2
        "dsa_replicated_indexer": (128 * (512 + 64 + 2 * 128) * 2, 128 * 704 * 2),
        # 128 x 656 x int8 + 128 x 128 x bfloat16 vs 128 x 784 x 2
        "dsa_sfa_c8": (128 * 656 + 128 * 128 * 2, 128 * 784 * 2),
    }
    for name, (page, real) in expected.items():
        case = cases[name]
        assert (case["page_size_bytes"], case["real_page_size_bytes"]) == (page, real), name
        assert (case["error"], case["field"], case["inherited_from"]) == (
            "TraitsMismatchError",
            "unpadded_page_size_bytes",
            "AttentionSpec",
        ), name
    # vllm-ascend's DeepSeek-V4 indexer passes MLAAttentionSpec.compress_ratio, which vLLM
    # 0.34 does not have: its own code cannot build that spec on 0.34.
    assert cases["dsv4_indexer"]["built"] is False
    assert "compress_ratio" in cases["dsv4_indexer"]["message"]
    # compress_ratio is outside 0.23.0.post1's SWA page (storage_block_size = block_size)
    assert cases["swa_compress_4"]["traits"]["page_size_bytes"] == 128 * 512 * 2


def test_newer_tree_sfa_indexer_and_its_refusals(newer: dict[str, Any]) -> None:
    assert newer["classes"] == [
        "AscendMLAAttentionSpec",
        "AscendSFAIndexerCacheSpec",
        "AscendSlidingWindowMLASpec",
    ]
    indexer = [r for r in newer["representatives"] if r["class"] == "AscendSFAIndexerCacheSpec"]
    # 1 replica x 128 tokens x 1 head x 128 bfloat16 key elements
    assert _pages(indexer) == [("AscendSFAIndexerCacheSpec", 128 * 128 * 2, 32768, 32768, 32768)]
    assert indexer[0]["traits"]["is_mla"] is True  # a key only: one vector per state
    cases = newer["cases"]
    # LI C8: 128 x (128 int8 + 1 float16) overridden, 128 x 128 x 1 inherited
    assert (cases["indexer_li_c8"]["page_size_bytes"], cases["indexer_li_c8"]["field"]) == (
        128 * (128 + 2),
        "unpadded_page_size_bytes",
    )
    # two DCP lanes' copies: 2 x 128 x 128 x 2 overridden, 128 x 128 x 2 inherited
    replicated = cases["indexer_replicated"]
    assert (replicated["page_size_bytes"], replicated["field"]) == (
        2 * 128 * 128 * 2,
        "unpadded_page_size_bytes",
    )
    # The newer MLA page divides by MLAAttentionSpec.compress_ratio, absent from vLLM 0.34
    assert (cases["mla_plain"]["error"], cases["mla_plain"]["field"]) == (
        "SpecPropertyError",
        "page_size_bytes",
    )
    assert newer["without_adapter"]["error"] == "SpecPropertyError"
    # Later trees store block_size // compress_ratio rows; vLLM counts 128 states: refused
    swa = cases["swa_compress_4"]
    assert (swa["real_page_size_bytes"], swa["storage_block_size"]) == (32 * 512 * 2, 32)
    assert (swa["error"], swa["field"]) == ("InvalidSpecError", "compress_ratio")


def _report(*path: Path) -> subprocess.CompletedProcess[str]:
    return fresh.run(
        [sys.executable, "-m", "kvspec_traits", "report"], env=_env(*path), timeout=300
    )


@pytest.mark.parametrize("tree", [RELEASE, NEWER], ids=["0.23.0.post1", "0.27.1rc1"])
def test_report_with_the_package_installed_is_ok(site: Path, tree: Path) -> None:
    done = _report(site, _tree(tree))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [
        line for line in done.stdout.splitlines() if "kvspec-traits-ascend representative" in line
    ]
    # the release: 4 MLA + 4 SWA-MLA; the newer tree: 4 SWA-MLA + 1 SFA indexer (its MLA
    # page needs MLAAttentionSpec.compress_ratio, which vLLM 0.34 lacks: no representative)
    assert len(rows) == (5 if tree is NEWER else 8), done.stdout
    assert "vllm_ascend.core.kv_cache_interface.AscendSlidingWindowMLASpec" in done.stdout
    assert not any("FAILED" in r for r in rows)


WRONG = '''
"""An Ascend adapter package that forgets the DSA indexer key in the MLA page."""
from kvspec_traits.extend import ATTENTION_IGNORES, ATTENTION_READS, Registry, attention_traits
import kvspec_traits_ascend as right
from kvspec_traits_ascend import representative_specs  # noqa: F401  (the report's hook)


def forgets_indexer(spec):
    dims = spec.sparse_head_dim
    if dims is None:
        return attention_traits(spec)
    cell = [("kv_lora", dims[0], spec.dtype), ("k_rope", dims[1], spec.dtype)]
    return attention_traits(spec, cell=cell)


def register(registry: Registry) -> None:
    right.register(registry)
    cls = right.spec_classes()["AscendMLAAttentionSpec"]
    registry.register(
        cls, forgets_indexer, reads=(*ATTENTION_READS, "sparse_head_dim"),
        ignores=ATTENTION_IGNORES, replace=True,
    )
'''


def test_a_wrong_adapter_fails_the_report(tmp_path: Path) -> None:
    """A wrong build of the package, installed under its name ahead of the right one (which
    bootstrap installs, and whose egg-info pip leaves in its src/): the first distribution
    of a name on the path is the one whose entry points load, so the wrong one is alone."""
    (tmp_path / "ascend_wrong").mkdir()
    (tmp_path / "ascend_wrong" / "__init__.py").write_text(WRONG)
    info = tmp_path / "kvspec_traits_ascend-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvspec-traits-ascend\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[kvspec_traits.adapters]\nascend = ascend_wrong:register\n"
    )
    lib = tmp_path / "lib"  # the right package's modules, which the wrong one builds on
    shutil.copytree(PACKAGE / "src" / "kvspec_traits_ascend", lib / "kvspec_traits_ascend")
    done = subprocess.run(
        [sys.executable, "-m", "kvspec_traits", "report"],
        env=_env(tmp_path, lib, _tree(RELEASE)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if "FAILED" in line]
    # the DSA representative: 128 x (512 + 64) x 2 = 147456 given, 180224 the spec's
    assert len(failed) == 1 and "AscendMLAAttentionSpec" in failed[0], done.stdout
    assert "147456" in failed[0] and "180224" in failed[0], failed[0]


FIXTURE = REPO / "tests" / "fixtures" / "ascend_audit"


def _audit(*path: Path, args: tuple[str, ...] = (), cache: Path | None = None) -> str:
    env = _env(*path)
    if cache is not None:  # the class-set cache of this test, not the user's
        env["KVSPEC_TRAITS_CACHE_DIR"] = str(cache)
    done = fresh.run(
        [sys.executable, "-m", "kvspec_traits", "audit", *args, str(FIXTURE)], env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


LATENT = (
    "; latent: the scanned code builds no instance of SlidingWindowMLASpec "
    "(the code names its subclass AscendSlidingWindowMLASpec) today\n"
)


def test_audit_a_vendor_subclass_in_a_tuple_covers_only_itself(site: Path, tmp_path: Path) -> None:
    """`isinstance(spec, (MLAAttentionSpec, AscendSlidingWindowMLASpec))`: vLLM's own
    SlidingWindowMLASpec is not an instance of the vendor subclass. With the vendor's
    classes known (the package installed) the site is a miss of it: near is_mla
    (similarity 0.83, high), lowered to medium because the fixture builds no
    SlidingWindowMLASpec (a latent miss, docs/audit.md "Vendor subclasses")."""
    out = _audit(site, _tree(RELEASE), cache=tmp_path)
    assert "kvspec-traits-ascend 0.1.0" in out.splitlines()[0]
    assert "MISSES SlidingWindowMLASpec" in out
    assert (
        "verdict: miss (medium): asks is_mla = True but leaves out SlidingWindowMLASpec" + LATENT
    ) in out


def test_audit_without_the_vendor_classes_names_the_unknown_one() -> None:
    """Without them (vLLM's class sets alone) the unknown class is named and the site is
    still a miss, never called covered."""
    out = _audit(args=("--no-extensions",))
    assert "MISSES SlidingWindowMLASpec" in out
    assert (
        "verdict: miss (medium): asks is_mla = True but leaves out SlidingWindowMLASpec; "
        "also tests AscendSlidingWindowMLASpec, no spec class the audit knows"
    ) in out


def test_audit_with_the_vendor_class_sets_saved(site: Path, tmp_path: Path) -> None:
    """The vendor's class sets saved where its package is installed (--save-classes), read
    back where neither the package nor vllm-ascend is (--classes): the same miss."""
    saved = tmp_path / "ascend-classes.json"
    _audit(site, _tree(RELEASE), args=("--save-classes", str(saved)), cache=tmp_path)
    sets = saved.read_text()
    assert "AscendSlidingWindowMLASpec" in sets and "AscendMLAAttentionSpec" in sets
    out = _audit(args=("--classes", str(saved)))
    assert (
        "verdict: miss (medium): asks is_mla = True but leaves out SlidingWindowMLASpec" + LATENT
    ) in out


@pytest.mark.parametrize("extensions", [True, False], ids=["installed", "no-extensions"])
def test_audit_the_vendor_tuple_on_the_newer_tree_is_a_latent_miss(
    site: Path, tmp_path: Path, extensions: bool
) -> None:
    """Issue 49 item 7, on vllm-ascend's own tree (0.27.1rc1, the whole package):
    `kv_p2p/mooncake_connector.py:2338`, `_get_spec_total_num_kv_heads`, asks
    `isinstance(spec, (MLAAttentionSpec, AscendSlidingWindowMLASpec))`. A plain
    SlidingWindowMLASpec fails it; the tree builds AscendSlidingWindowMLASpec
    (models/deepseek_v4) and never a SlidingWindowMLASpec, so the miss is latent: medium.
    Before, the audit read the vendor class as standing for its base and called the site
    "ok (high): asks exactly one trait's classes" where the tree defines the class and no
    adapter package is installed (--no-extensions). With the package installed the class
    sets know the class (the is_mla classes with Ascend's among them: near, 0.83); without
    it the site is judged on vLLM's classes alone (near, 0.67): a miss either way."""
    tree = _tree(NEWER)
    env = _env(site, tree) if extensions else _env(tree)
    env["KVSPEC_TRAITS_CACHE_DIR"] = str(tmp_path)
    args = () if extensions else ("--no-extensions",)
    done = fresh.run(
        [sys.executable, "-m", "kvspec_traits", "audit", *args, str(tree / "vllm_ascend")],
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    (at,) = [
        i for i, line in enumerate(lines) if "2338  MooncakeConnectorWorker._get_spec_total" in line
    ]
    assert lines[at].endswith("isinstance(spec, (MLAAttentionSpec, AscendSlidingWindowMLASpec))")
    assert lines[at + 1].strip() == "MISSES SlidingWindowMLASpec"
    similarity = "0.83" if extensions else "0.67"
    assert f"(near match, similarity {similarity})" in lines[at + 2]
    verdict = lines[at + 3].strip()
    assert verdict.startswith(
        "verdict: miss (medium): asks is_mla = True but leaves out SlidingWindowMLASpec"
    ), verdict
    assert verdict.endswith(LATENT.strip()), verdict


def test_audit_and_migrate_on_the_release_tree(site: Path, tmp_path: Path) -> None:
    """The figures docs/audit.md reads by hand ("vllm-ascend 0.23.0.post1"): 105 sites, the
    two misses, and migrate's 81 rewrites with the 11 class-name strings left alone."""
    tree = _tree(RELEASE)
    folders = [
        str(tree / "vllm_ascend" / "distributed" / "kv_transfer"),
        str(tree / "vllm_ascend" / "worker"),
    ]
    env = _env(site, tree)
    env["KVSPEC_TRAITS_CACHE_DIR"] = str(tmp_path)
    audit = fresh.run(
        [sys.executable, "-m", "kvspec_traits", "audit", *folders], env=env, timeout=300
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert (
        audit.stdout.rstrip()
        .splitlines()[-1]
        .startswith(
            "105 sites in 13 files; 2 with misses, 0 possible, 0 deliberate, "
            "0 exact type checks skipping subclasses, 0 group wrappers not unwrapped"
        )
    )
    assert "MISSES AscendSlidingWindowMLASpec, SlidingWindowMLASpec" in audit.stdout
    assert audit.stdout.count("verdict: miss (high)") == 2, audit.stdout
    assert "2168  MooncakeConnectorWorker._get_spec_total_num_kv_heads" in audit.stdout
    assert "479  _reshape_kv_cache_v2" in audit.stdout
    migrate = fresh.run(
        [sys.executable, "-m", "kvspec_traits", "migrate", *folders], env=env, timeout=300
    )
    assert migrate.returncode == 0, migrate.stderr
    assert migrate.stderr.rstrip().splitlines()[-1] == (
        "kvspec-traits migrate: 105 sites; would rewrite 81 in 11 files (2 fixing a miss); "
        "left 24; refused 0 files"
    )
    assert migrate.stderr.count("[type-name: no instance expression to rewrite]") == 11
    assert migrate.stdout.count("fixes a miss") == 2
