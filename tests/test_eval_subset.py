"""Bounded validation: every evaluation, restart and world size validates on the same items."""

from __future__ import annotations

import json

import pytest

from thinwire.workloads.base import eval_part, eval_subset


@pytest.mark.parametrize("n, batches, batch", [(10, 1, 4), (250_000, 20, 48), (359, 20, 64), (7, 0, 2), (5, 3, 1)])
def test_the_subset_is_the_same_at_every_world_size(n, batches, batch):
    subset = eval_subset(n, batches, batch)
    assert subset == eval_subset(n, batches, batch)  # every evaluation, every restart
    assert len(subset) == (n if batches == 0 else min(n, batches * batch)) == len(set(subset))
    assert subset[0] == 0 and subset[-1] == n - 1 and all(0 <= i < n for i in subset)  # spread over the set
    for world in (1, 2, 3):
        parts = [subset[rank::world] for rank in range(world)]
        assert sorted(i for part in parts for i in part) == sorted(subset)


@pytest.mark.parametrize("shares", [[4, 4], [3, 1], [10, 9, 9, 4], [1, 31], [2, 1, 1]])
def test_ranks_validate_disjoint_parts_of_the_subset_in_proportion_to_their_shares(shares):
    for n in (0, 1, 7, 64, 359):
        parts = [eval_part(n, shares, rank) for rank in range(len(shares))]
        assert sorted(i for part in parts for i in part) == list(range(n))   # each item once
        for part, share in zip(parts, shares):   # equal shares: every p-th item; a plan's: by its share
            assert abs(len(part) - n * share / sum(shares)) <= 1
    assert eval_part(64, [1, 31], 0) == range(0, 2)   # a host given 1 of 32 validates 2 items, not 32 one by one


@pytest.mark.slow
def test_a_bounded_validation_gives_the_same_loss_on_1_and_2_workers(tmp_path):
    from tests.test_cli import thinwire

    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"n{nproc}"
        run = thinwire("train", "--workload", "digits", "--nproc", str(nproc), "--steps", "1", "--eval-every", "1",
                       "--set", "eval_batches=1", "--set", "lr=1e-9", "--out", str(out))
        assert run.returncode == 0, run.stderr[-2000:]
        losses[nproc] = [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                         if "val_loss" in line]
    full = tmp_path / "full"
    assert thinwire("train", "--workload", "digits", "--steps", "1", "--eval-every", "1", "--set", "eval_batches=0",
                    "--set", "lr=1e-9", "--out", str(full)).returncode == 0
    whole = [json.loads(line)["val_loss"] for line in (full / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in line]
    assert losses[1] == pytest.approx(losses[2], rel=1e-5)  # the same 64 items, split over 1 or 2 ranks
    assert losses[1] != pytest.approx(whole, rel=1e-5)  # and not the whole set: the bound is in force
