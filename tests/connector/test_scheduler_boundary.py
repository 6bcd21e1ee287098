"""An unexpected error inside the connector's scheduler half stays inside it: the
request it hit recomputes, vLLM never sees the exception, other requests go on
(docs/connector.md, "Failures": "any bug in the connector").

The errors are real ones of kvtier's code, reached through vLLM's hooks with input
that breaks an assumption (a tier client raising something other than a tier error;
a step whose block ids cannot hold the promised hit).
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.connector.test_vllm_scheduler import FakeTier, blocks, make_scheduler, request, step


class BuggyTier(FakeTier):
    """A tier client with a bug: its first lookup raises a plain ``ValueError``."""

    def lookup(self, keys: Sequence[bytes], *, timeout_s: float | None = None) -> int:
        if not self.lookups:
            self.lookups.append(list(keys))
            raise ValueError("a bug, not a tier error")
        return super().lookup(keys, timeout_s=timeout_s)


def test_an_unexpected_error_in_a_lookup_is_a_miss_for_that_request_only() -> None:
    scheduler, _ = make_scheduler(BuggyTier(held=3))

    assert scheduler.get_num_new_matched_tokens(request(1000, "first"), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(request(1000, "second"), 0) == (768, False)


def test_a_load_that_cannot_be_planned_reports_its_blocks_failed_and_plans_no_load() -> None:
    scheduler, _ = make_scheduler(FakeTier(held=3))
    req = request(1000)
    ext, _ = scheduler.get_num_new_matched_tokens(req, 0)
    assert ext == 768
    scheduler.update_state_after_alloc(req, blocks(list(range(8))), ext)
    too_few = [40, 41]  # the hit needs 6 blocks

    plan = scheduler.build_connector_meta(step([(req, too_few, 0, 1000)]))

    assert plan.loads == []
    assert plan.failed_blocks == too_few  # vLLM recomputes them (never left unfilled)
    other = request(1000, "other")
    assert scheduler.get_num_new_matched_tokens(other, 0) == (768, False)
