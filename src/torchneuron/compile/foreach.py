"""``_foreach_*`` graph nodes without a lowering of their own run element by element through their
base op's lowering; the plan lives with the ops (``ops/foreach_plan.py``), where the eager dtype
checks read it too."""

from __future__ import annotations

from ..ops.foreach_plan import ForeachPlan, foreach_plan

__all__ = ["ForeachPlan", "foreach_plan"]
