"""The transfer -> decode flow with each consumption policy, as spawned workers."""

from __future__ import annotations

import pytest

from workers.decode import Policy
from workers.launcher import FlowConfig, FlowResult, run_flow

REQUESTS = 20_000


def _flow(policy: Policy) -> FlowResult:
    return run_flow(
        FlowConfig(
            requests=REQUESTS,
            transfer_workers=2,
            decode_workers=2,
            slots=64,
            policy=policy,
            burst=64,
            transfer_abort=0.02,
            decode_abort=0.02,
            timeout_s=200,
        )
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["hold", "clone"])
def test_correct_policies_deliver_every_row_intact(policy: Policy) -> None:
    result = _flow(policy)
    p = result.progress
    assert result.published + result.transfer_aborted == REQUESTS
    assert result.transfer_aborted > 0 and p.decode_aborted > 0
    assert p.corrupted == 0
    assert p.verified + p.decode_aborted == result.published
    assert result.accounted  # published = consumed + aborted, tag by tag
    assert result.final.owned == 0 and result.final.queued == 0
    assert result.final.counters["leaked_views"] == 0
    assert p.copies == (p.verified + p.decode_aborted if policy == "clone" else 0)


@pytest.mark.timeout(240)
def test_early_release_is_caught() -> None:
    """Views kept past release must show up: as corrupted rows, leaked views, or both."""
    result = _flow("early-release")
    p = result.progress
    leaked = result.final.counters["leaked_views"]
    assert p.corrupted > 0 or leaked > 0
    assert leaked > 0  # every early release keeps views: the detector must see them
    assert result.accounted and result.final.owned == 0
