"""kvspec_workbench.hand_edits: the patch's hand edits apply whole or not at all (issue 35)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvspec_traits.migrate import MigrationPlan, Skip
from kvspec_workbench import hand_edits


def _module() -> Any:
    return hand_edits


def _moriio(module: Any) -> Any:
    return next(
        h
        for h in module.hand_edits_for("0.34.0")
        if h.path.endswith("moriio_connector.py") and h.sites
    )


def _tree(tmp_path: Path, module: Any, text: str) -> Path:
    kv = tmp_path / "kv_transfer"
    path = kv / _moriio(module).path
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return kv


def test_a_before_text_not_in_the_file_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    module = _module()
    kv = _tree(tmp_path, module, "from vllm import x\n")
    plan = MigrationPlan()
    # the series' first edit is NIXL's, whose file this tree lacks: refused by name
    with pytest.raises(module.HandEditError, match="no such file"):
        module.apply_hand_edits(plan, kv, "0.34.0")
    module.HAND_EDITS = (_moriio(module),)
    with pytest.raises(module.HandEditError, match="found 0 times"):
        module.apply_hand_edits(plan, kv, "0.34.0")
    assert plan.files == [] and plan.skips == []
    assert (kv / _moriio(module).path).read_text() == "from vllm import x\n"


def test_an_edit_applies_once_and_takes_its_site_off_the_skips(tmp_path: Path) -> None:
    """MoRIIO's edit alone: its before-text becomes its after-text, the kvspec_traits
    import gains what it needs, and its site leaves the skips."""
    module = _module()
    edit = _moriio(module)
    text = "from kvspec_traits import traits_of\nfrom vllm import x\n" + edit.before
    kv = _tree(tmp_path, module, text)
    skip = Skip(
        path=str(kv / edit.path), line=3, text=edit.sites[0], verdict="", reason="closest match"
    )
    plan = MigrationPlan(skips=[skip])
    module.HAND_EDITS = (edit,)
    new, applied = module.apply_hand_edits(plan, kv, "0.34.0")
    assert applied == [edit] and new.skips == [] and plan.skips == [skip]
    (after,) = [f.after for f in new.files]
    assert edit.after in after and edit.before not in after
    assert "from kvspec_traits import TokenScope, traits_of\n" in after
    # the same site declared again, no longer among the skips: refused
    with pytest.raises(module.HandEditError, match="not a site migrate left"):
        module.apply_hand_edits(MigrationPlan(), kv, "0.34.0")
