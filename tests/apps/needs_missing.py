"""An app module whose own import fails: one of its dependencies is missing.

The missing module's name happens to be a prefix of this module's name, as ``billing`` is of
``billing_tasks``; the CLI must still report the dependency, not claim that this module cannot be found.
"""

from __future__ import annotations

import pgflow
import tests.apps.needs  # noqa: F401  - does not exist, on purpose

app = pgflow.App()
