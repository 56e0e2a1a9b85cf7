"""``kvspec-traits migrate``: a LibCST codemod that rewrites the audit's exact-match
branches on spec classes into traits queries (and fixes its misses), leaving formatting
and comments as they were. See docs/migration.md."""

from kvspec_traits._deps import needs

with needs("kvspec-traits migrate (the codemod edits source with LibCST)"):
    from kvspec_traits.migrate._cli import EXIT_REFUSED, main
    from kvspec_traits.migrate._migrate import (
        FilePlan,
        MigrationPlan,
        Refusal,
        plan_migration,
        write_plan,
    )
    from kvspec_traits.migrate._plan import REWRITTEN_FORMS, Edit, Skip

__all__ = [
    "EXIT_REFUSED",
    "REWRITTEN_FORMS",
    "Edit",
    "FilePlan",
    "MigrationPlan",
    "Refusal",
    "Skip",
    "main",
    "plan_migration",
    "write_plan",
]
