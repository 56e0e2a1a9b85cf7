"""A missing runtime piece is a named error saying what to install, never a bare
``ModuleNotFoundError`` (and ``report`` a sentence and exit 2, no traceback).

Each case runs in a fresh interpreter where the piece is made unimportable
(``sys.modules[name] = None``: ``import name`` then raises ``ModuleNotFoundError``, as
when it is not installed). tests/install/ checks the same in a real venv without them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvspec_traits import MissingDependencyError

_PRELUDE = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None
from kvspec_traits import MissingDependencyError
try:
{body}
except MissingDependencyError as exc:
    print("NAMED", exc.name, "|", exc.feature, "|", exc)
    print("IS_MODULE_NOT_FOUND", isinstance(exc, ModuleNotFoundError))
else:
    print("NO ERROR")
"""


def _run(hidden: tuple[str, ...], body: str) -> str:
    code = _PRELUDE.format(
        hidden=hidden, body="\n".join("    " + line for line in body.splitlines())
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


CASES = {
    # what is hidden, what runs, the missing module named, what the message must say
    "traits_of without vLLM": (
        ("vllm",),
        "import kvspec_traits\nkvspec_traits.traits_of(object())",
        "vllm",
        "resolving vLLM KV cache specs",
        "Install vLLM (a supported series: 0.32.x, 0.33.x",
    ),
    "traits_of without torch": (
        ("torch",),
        "import kvspec_traits\nkvspec_traits.traits_of(object())",
        "torch",
        "resolving vLLM KV cache specs",
        "torch comes with vLLM",
    ),
    "NIXL shim without numpy": (
        ("numpy",),
        "import kvspec_traits.nixl",
        "numpy",
        "the NIXL shim",
        "`pip install numpy`",
    ),
    "NIXL agent without NIXL": (
        ("nixl",),
        "from kvspec_traits.nixl import TraitsNixlAgent\nTraitsNixlAgent()",
        "nixl",
        "TraitsNixlAgent",
        "pip install --no-deps nixl",
    ),
    "Mooncake engine without Mooncake": (
        ("mooncake",),
        "from kvspec_traits.mooncake import TraitsMooncakeEngine\nTraitsMooncakeEngine()",
        "mooncake",
        "TraitsMooncakeEngine",
        "`pip install mooncake-transfer-engine-non-cuda`",
    ),
    "plugin without vLLM": (
        ("vllm",),
        "from kvspec_traits.vllm_connector import register_with_vllm\nregister_with_vllm()",
        "vllm",
        "vLLM plugin",
        "Install vLLM",
    ),
    "connector class without vLLM": (
        ("vllm",),
        "import kvspec_traits.vllm_connector as c\nc.TraitsNixlConnector",
        "vllm",
        "TraitsNixlConnector",
        "Install vLLM",
    ),
    "catalog without vLLM": (
        ("vllm",),
        "import kvspec_traits.catalog",
        "vllm",
        "kvspec_traits.catalog",
        "Install vLLM",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_piece_is_a_named_error_saying_what_to_install(case: str) -> None:
    hidden, body, module, feature, advice = CASES[case]
    out = _run(hidden, body)
    assert out.startswith(f"NAMED {module} | "), out
    named = out.splitlines()[0]
    assert feature in named, named
    assert advice in named, named
    assert "IS_MODULE_NOT_FOUND True" in out


def test_the_error_carries_the_module_and_what_to_install() -> None:
    err = MissingDependencyError("numpy", "the NIXL shim", "pip install x")
    assert isinstance(err, ModuleNotFoundError)
    assert (err.name, err.feature, err.install) == ("numpy", "the NIXL shim", "pip install x")
    assert str(err) == (
        "the NIXL shim needs the 'numpy' module, which is not installed. pip install x"
    )


def test_report_without_vllm_is_a_sentence_and_exit_2() -> None:
    code = (
        "import sys\nsys.modules['vllm'] = None\nfrom kvspec_traits._cli import main\n"
        "sys.exit(main(['report']))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(
        "kvspec-traits report: listing the traits of the "
        "installed vLLM's KV cache specs needs the 'vllm' module, "
        "which is not installed. Install vLLM"
    ), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_missing_module_of_ours_is_not_disguised() -> None:
    """Only runtime pieces we name get the named error; anything else is a bug to see."""
    from kvspec_traits._deps import needs

    with pytest.raises(ModuleNotFoundError) as raised, needs("a feature"):
        import kvspec_traits._no_such_module  # type: ignore[import-not-found]  # noqa: F401
    assert not isinstance(raised.value, MissingDependencyError)


# Mooncake's engine.so links libibverbs.so.1 (Debian's libibverbs1) even for TCP: without
# it, `import mooncake.engine` is a plain ImportError from the dynamic loader.
_NO_IBVERBS = """
import importlib.abc, sys
class NoIbverbs(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mooncake.engine":
            raise ImportError(
                "libibverbs.so.1: cannot open shared object file: No such file or directory"
            )
        return None
sys.meta_path.insert(0, NoIbverbs())
from kvspec_traits.mooncake import TraitsMooncakeEngine
TraitsMooncakeEngine()
"""


@pytest.mark.parametrize(
    ("hidden", "body"),
    [
        (
            ("mooncake",),
            "from kvspec_traits.mooncake import TraitsMooncakeEngine\nTraitsMooncakeEngine()",
        ),
        ((), _NO_IBVERBS),
    ],
    ids=["no wheel", "no libibverbs1"],
)
def test_a_missing_mooncake_engine_names_the_wheel_and_libibverbs1(
    hidden: tuple[str, ...], body: str
) -> None:
    """Either half missing (the wheel, or the system library its engine.so loads) is one
    MissingDependencyError naming both installs; importing the backend needs neither."""
    out = _run(hidden, body)
    assert out.startswith("NAMED mooncake | TraitsMooncakeEngine"), out
    named = out.splitlines()[0]
    assert "`pip install mooncake-transfer-engine-non-cuda`" in named, named
    assert "`apt-get install libibverbs1`" in named, named
    assert ("libibverbs.so.1: cannot open" in named) == (not hidden), named
    assert "IS_MODULE_NOT_FOUND True" in out
