"""Retention policies and plans: which committed checkpoints survive a prune.

Every table row is a situation that lost someone a checkpoint in another trainer
(FAILURE_MODES B1-B3, B6): recency by mtime or by string, the best or the newest
deleted, pre-restart checkpoints not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atomic_checkpoint.manifest import CheckpointInfo
from atomic_checkpoint.retention import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLast,
    Pin,
    RetentionPolicy,
    describe_plan,
    plan_deletions,
    unrecorded_metrics,
)

NAN = math.nan


def ck(
    step: int,
    loss: float | None = None,
    *,
    created: float | None = None,
    seq: int | None = None,
    run_id: str = "run-a",
    **metrics: float,
) -> CheckpointInfo:
    """A committed checkpoint; ``loss`` becomes the ``eval_loss`` metric."""
    if loss is not None:
        metrics["eval_loss"] = loss
    return CheckpointInfo(
        step=step,
        path=f"/ckpt/checkpoint-{step}",
        size_bytes=1024,
        metrics=metrics,
        created_unix=float(step) if created is None else created,
        run_id=run_id,
        commit_seq=step if seq is None else seq,
    )


def series(*steps: int) -> list[CheckpointInfo]:
    return [ck(s) for s in steps]


def deleted_steps(
    policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointInfo]
) -> list[int]:
    return [info.step for info in plan_deletions(policy, checkpoints)]


BEST_OLD = [ck(100, 0.9), ck(200, 0.1), ck(300, 0.5), ck(400, 0.4), ck(500, 0.6), ck(600, 0.7)]

# Steps 0..4000 every 500; eval_loss is recorded on some only and is best at 2000.
FOUR_WAY = [
    ck(0),
    ck(500, 0.8),
    ck(1000, 0.6),
    ck(1500),
    ck(2000, 0.2),
    ck(2500, 0.5),
    ck(3000),
    ck(3500, 0.7),
    ck(4000),
]

# A job saved 100..400, died, resumed from 400 and saved 500 and 600 on a node whose
# clock is behind, so the post-restart checkpoints look older by created_unix.
RESUMED = [
    ck(100, 0.50, created=1_000.0, seq=1),
    ck(200, 0.05, created=1_100.0, seq=2),
    ck(300, 0.40, created=1_200.0, seq=3),
    ck(400, 0.30, created=1_300.0, seq=4),
    ck(500, 0.35, created=500.0, seq=5),
    ck(600, 0.45, created=600.0, seq=6),
]

PLAN_CASES = [
    pytest.param(KeepLast(3), series(100, 200, 300, 400, 500, 600), [100, 200, 300], id="last-3"),
    pytest.param(KeepLast(10), series(100, 200, 300), [], id="last-n-more-than-exist"),
    pytest.param(KeepLast(1), series(100, 200, 300), [100, 200], id="last-1-keeps-newest-only"),
    pytest.param(
        KeepLast(2) | KeepBest(1), BEST_OLD, [100, 300, 400], id="best-older-than-last-n-kept"
    ),
    pytest.param(KeepLast(1) | KeepBest(1), BEST_OLD, [100, 300, 400, 500], id="last-1-plus-best"),
    pytest.param(
        KeepBest(1), [ck(100, 0.1), ck(200, 0.5), ck(300, 0.9)], [200], id="newest-kept-best-only"
    ),
    pytest.param(KeepEvery(1000), series(1000, 1500, 2000, 2500), [1500], id="newest-kept-every"),
    pytest.param(Pin([100]), series(100, 200, 300), [200], id="newest-kept-pin-only"),
    pytest.param(
        KeepBest(1), [ck(100), ck(200), ck(300)], [100, 200], id="newest-kept-metric-missing-all"
    ),
    pytest.param(
        KeepBest(2),
        [ck(100, 0.5), ck(200), ck(300, 0.4), ck(400), ck(500)],
        [200, 400],
        id="metric-missing-on-some",
    ),
    pytest.param(
        KeepBest(1, metric="bleu", mode="max"),
        [ck(100, 0.1, bleu=20.0), ck(200, 0.05), ck(300, 0.3, bleu=25.0), ck(400, 0.2)],
        [100, 200],
        id="metric-present-under-other-name-only",
    ),
    pytest.param(
        KeepBest(1),
        [ck(100, 0.9), ck(200, NAN), ck(300, 0.8), ck(400, 1.0)],
        [100, 200],
        id="nan-never-best-min",
    ),
    pytest.param(
        KeepBest(1, metric="accuracy", mode="max"),
        [
            ck(100, accuracy=0.9),
            ck(200, accuracy=NAN),
            ck(300, accuracy=0.95),
            ck(400, accuracy=0.1),
        ],
        [100, 200],
        id="nan-never-best-max",
    ),
    pytest.param(
        KeepBest(1),
        [ck(100, NAN), ck(200, 0.3), ck(300, NAN), ck(400, NAN)],
        [100, 300],
        id="nan-everywhere-but-one",
    ),
    pytest.param(
        KeepBest(1), [ck(100, 0.2), ck(200, 0.2), ck(300, 0.5)], [100], id="tie-prefers-newer"
    ),
    pytest.param(
        KeepBest(2),
        [ck(100, 0.1), ck(200, 0.2), ck(300, 0.2), ck(400, 0.9), ck(500, 0.9)],
        [200, 400],
        id="tie-at-k-boundary-prefers-newer",
    ),
    pytest.param(
        KeepBest(1, metric="accuracy", mode="max"),
        [
            ck(100, accuracy=0.7),
            ck(200, accuracy=0.9),
            ck(300, accuracy=0.8),
            ck(400, accuracy=0.6),
        ],
        [100, 300],
        id="max-mode",
    ),
    pytest.param(
        KeepBest(1, metric="accuracy", mode="max"),
        [ck(100, accuracy=0.9), ck(200, accuracy=0.9), ck(300, accuracy=0.1)],
        [100],
        id="max-mode-tie-prefers-newer",
    ),
    pytest.param(
        KeepBest(1),
        [ck(100, -math.inf), ck(200, 0.0), ck(300, math.inf), ck(400, 1.0)],
        [200, 300],
        id="infinite-values-rank-normally",
    ),
    pytest.param(KeepEvery(500), series(0, 250, 500, 750), [250], id="every-includes-step-0"),
    pytest.param(KeepEvery(1), series(0, 1, 2, 3), [], id="every-1-keeps-all"),
    pytest.param(
        Pin([150, 200, 9999]), series(100, 200, 300), [100], id="pin-steps-that-dont-exist"
    ),
    pytest.param(Pin([]), series(100, 200), [100], id="pin-nothing"),
    pytest.param(
        KeepLast(2) | KeepBest(1) | KeepEvery(1000) | Pin([1500]),
        FOUR_WAY,
        [500, 2500],
        id="combination-of-all-four",
    ),
    pytest.param(
        KeepLast(2), [ck(9), ck(100), ck(10)], [9], id="string-order-differs-from-numeric"
    ),
    pytest.param(
        KeepLast(3),
        series(2, 10, 1, 100, 9, 1000, 99),
        [1, 2, 9, 10],
        id="unordered-mixed-digit-counts",
    ),
    pytest.param(
        KeepLast(2),
        [ck(100, created=3_000.0), ck(200, created=2_000.0), ck(300, created=1_000.0)],
        [100],
        id="created-unix-reversed-is-ignored",
    ),
    pytest.param(
        KeepLast(2),
        [ck(300, seq=1), ck(100, seq=3), ck(200, seq=2)],
        [100],
        id="commit-seq-order-is-ignored",
    ),
    pytest.param(
        KeepLast(3) | KeepBest(1), RESUMED, [100, 300], id="resumed-run-counts-pre-restart"
    ),
    pytest.param(
        KeepLast(2), list(reversed(RESUMED)), [100, 200, 300, 400], id="resumed-run-last-2"
    ),
    pytest.param(
        KeepLast(1),
        [ck(10**18 + 1), ck(10**18), ck(999_999_999_999_999_999)],
        [999_999_999_999_999_999, 10**18],
        id="huge-steps",
    ),
    pytest.param(KeepAll(), series(100, 200, 300), [], id="keep-all"),
    pytest.param(KeepAll() | KeepLast(1), series(100, 200, 300), [], id="keep-all-in-combination"),
    pytest.param(None, series(100, 200, 300), [], id="no-policy-keeps-everything"),
    pytest.param(KeepLast(1), [], [], id="empty-input"),
    pytest.param(None, [], [], id="empty-input-no-policy"),
    pytest.param(KeepBest(1), [ck(100)], [], id="single-checkpoint-without-metric"),
]


@pytest.mark.parametrize(("policy", "checkpoints", "expected"), PLAN_CASES)
def test_plan_deletions(
    policy: RetentionPolicy | None, checkpoints: list[CheckpointInfo], expected: list[int]
) -> None:
    assert deleted_steps(policy, checkpoints) == expected
    # The same plan whatever the input order.
    assert deleted_steps(policy, list(reversed(checkpoints))) == expected


@pytest.mark.parametrize(("policy", "checkpoints", "expected"), PLAN_CASES)
def test_describe_plan_agrees_with_plan_deletions(
    policy: RetentionPolicy | None, checkpoints: list[CheckpointInfo], expected: list[int]
) -> None:
    rows = describe_plan(policy, checkpoints)
    assert [info.step for info, _, _ in rows] == sorted(info.step for info in checkpoints)
    assert [info.step for info, is_kept, _ in rows if not is_kept] == expected
    assert all(reason for _, _, reason in rows)


def test_plan_returns_the_given_checkpoint_objects() -> None:
    checkpoints = [ck(300), ck(100), ck(200)]
    plan = plan_deletions(KeepLast(1), checkpoints)
    assert plan == [checkpoints[1], checkpoints[2]]
    assert plan[0] is checkpoints[1]


# A policy on its own (no newest guarantee): what keep() returns.
KEEP_CASES = [
    pytest.param(KeepLast(2), series(10, 9, 100), {10, 100}, id="last-by-integer-step"),
    pytest.param(KeepBest(1), [ck(300, 0.9), ck(100, 0.1), ck(200, 0.5)], {100}, id="best-only"),
    pytest.param(
        KeepBest(3), [ck(100, 0.3), ck(200), ck(300, NAN)], {100}, id="best-fewer-eligible-than-k"
    ),
    pytest.param(KeepEvery(1000), series(0, 1000, 2500), {0, 1000}, id="every-drops-newest"),
    pytest.param(Pin([5, 7]), series(5, 6), {5}, id="pin-ignores-missing"),
    pytest.param(KeepAll(), series(3, 1, 2), {1, 2, 3}, id="all"),
    pytest.param(KeepLast(1) | Pin([1]), series(3, 1, 2), {1, 3}, id="any-of-is-union"),
    pytest.param(KeepLast(5), [], set(), id="empty"),
]


@pytest.mark.parametrize(("policy", "checkpoints", "expected"), KEEP_CASES)
def test_keep(
    policy: RetentionPolicy, checkpoints: list[CheckpointInfo], expected: set[int]
) -> None:
    kept = policy.keep(checkpoints)
    assert isinstance(kept, frozenset)
    assert kept == expected


def test_describe_plan_reasons() -> None:
    checkpoints = [
        ck(1000, 0.12),
        ck(1500, 0.5),
        ck(2000, 0.4),
        ck(2500, 0.3),
        ck(3000, 0.35),
        ck(3500, 0.6),
        ck(500, 0.7),
    ]
    policy = KeepLast(3) | KeepBest(1) | KeepEvery(1000) | Pin([1500])
    rows = [
        (info.step, is_kept, reason) for info, is_kept, reason in describe_plan(policy, checkpoints)
    ]
    assert rows == [
        (
            500,
            False,
            "not kept by KeepLast(3) | KeepBest(1, metric='eval_loss', mode='min') "
            "| KeepEvery(1000) | Pin([1500])",
        ),
        (1000, True, "best eval_loss=0.12, every 1000"),
        (1500, True, "pinned"),
        (2000, True, "every 1000"),
        (2500, True, "last 3"),
        (3000, True, "last 3, every 1000"),
        (3500, True, "newest, last 3"),
    ]


@pytest.mark.parametrize(
    ("policy", "newest_reason", "other_reason"),
    [
        pytest.param(None, "newest, no retention policy", "no retention policy", id="no-policy"),
        pytest.param(KeepAll(), "newest, keep all", "keep all", id="keep-all"),
        pytest.param(KeepBest(1), "newest", "best eval_loss=0.1", id="newest-not-chosen-by-policy"),
    ],
)
def test_describe_plan_newest_reason(
    policy: RetentionPolicy | None, newest_reason: str, other_reason: str
) -> None:
    rows = describe_plan(policy, [ck(200, 0.5), ck(100, 0.1)])
    assert [(info.step, is_kept, reason) for info, is_kept, reason in rows] == [
        (100, True, other_reason),
        (200, True, newest_reason),
    ]


@dataclasses.dataclass(frozen=True)
class KeepOdd:
    """A user policy that only implements the protocol (no ``|``, no reasons)."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(c.step for c in checkpoints if c.step % 2) | {10**9}


def test_user_policy_is_a_retention_policy() -> None:
    assert isinstance(KeepOdd(), RetentionPolicy)
    assert isinstance(KeepLast(1) | KeepOdd(), RetentionPolicy)
    assert not isinstance(3, RetentionPolicy)


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(KeepOdd(), id="alone"),
        pytest.param(KeepLast(1) | KeepOdd(), id="right-of-or"),
        pytest.param(KeepOdd() | KeepLast(1), id="left-of-or"),
    ],
)
def test_user_policy_composes_and_is_described(policy: RetentionPolicy) -> None:
    checkpoints = series(1, 2, 3, 4, 6)
    assert deleted_steps(policy, checkpoints) == [2, 4]
    reasons = {info.step: reason for info, _, reason in describe_plan(policy, checkpoints)}
    assert "kept by KeepOdd()" in reasons[3]
    assert reasons[6].startswith("newest")
    assert "KeepOdd()" in reasons[2]


class KeepLastAndMilestones(KeepLast):
    """A subclass of a built-in policy that overrides ``keep`` only."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        return super().keep(checkpoints) | {c.step for c in checkpoints if c.metrics.get("ms")}


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(KeepLastAndMilestones(2), id="alone"),
        pytest.param(KeepLastAndMilestones(2) | KeepBest(1), id="left-of-or"),
        pytest.param(KeepEvery(1000) | KeepLastAndMilestones(2), id="right-of-or"),
    ],
)
def test_a_subclass_overriding_keep_keeps_what_it_adds_inside_or_and_in_the_plan(
    policy: RetentionPolicy,
) -> None:
    # Inside `|` the base class's reasons() were asked, never the override: the
    # milestone it keeps was deleted; describe_plan called it "not kept" even alone.
    checkpoints = [ck(1), ck(2, ms=1.0), ck(3), ck(4), ck(5), ck(6)]
    assert deleted_steps(policy, checkpoints) == [1, 3, 4]
    rows = {info.step: (kept, why) for info, kept, why in describe_plan(policy, checkpoints)}
    assert rows[2] == (True, "kept by KeepLastAndMilestones(2)")
    assert rows[5] == (True, "last 2") and not rows[4][0]


def test_numpy_integer_steps_from_keep_are_steps() -> None:
    np = pytest.importorskip("numpy")

    class TopTwo:
        def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
            steps = np.array([c.step for c in checkpoints])
            return frozenset(steps[np.argsort(steps)[-2:]])

    assert deleted_steps(TopTwo(), series(1, 2, 3, 4)) == [1, 2]


def test_a_policy_class_instead_of_an_object_is_refused_inside_or() -> None:
    # Accepted, it failed at every rotation (keep() missing an argument): nothing was
    # ever deleted and the disk filled.
    with pytest.raises(TypeError, match="not the class KeepOdd itself"):
        KeepLast(1) | KeepOdd  # type: ignore[operator]
    with pytest.raises(TypeError, match="not the class KeepLast itself"):
        AnyOf(KeepLast)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "text"),
    [
        pytest.param(KeepLast(3), "KeepLast(3)", id="last"),
        pytest.param(
            KeepBest(1, metric="eval_loss", mode="min"),
            "KeepBest(1, metric='eval_loss', mode='min')",
            id="best",
        ),
        pytest.param(KeepEvery(1000), "KeepEvery(1000)", id="every"),
        pytest.param(Pin([5000, 1000, 1000]), "Pin([1000, 5000])", id="pin-sorted-deduped"),
        pytest.param(KeepAll(), "KeepAll()", id="all"),
        pytest.param(
            KeepLast(3) | KeepBest(1, metric="eval_loss", mode="min"),
            "KeepLast(3) | KeepBest(1, metric='eval_loss', mode='min')",
            id="or",
        ),
        pytest.param(
            (KeepLast(3) | KeepEvery(10)) | (Pin([1]) | KeepAll()),
            "KeepLast(3) | KeepEvery(10) | Pin([1]) | KeepAll()",
            id="nested-or-flattened",
        ),
        pytest.param(AnyOf(KeepLast(2)), "AnyOf(KeepLast(2))", id="any-of-one"),
    ],
)
def test_repr_is_readable_and_evaluates_back(policy: RetentionPolicy, text: str) -> None:
    assert repr(policy) == text
    namespace = {
        "AnyOf": AnyOf,
        "KeepAll": KeepAll,
        "KeepBest": KeepBest,
        "KeepEvery": KeepEvery,
        "KeepLast": KeepLast,
        "Pin": Pin,
    }
    assert eval(text, namespace) == policy


def test_or_is_associative_and_equal_to_any_of() -> None:
    a, b, c = KeepLast(2), KeepBest(1), KeepEvery(100)
    assert (a | b) | c == a | (b | c) == AnyOf(a, b, c)
    assert (a | b | c).policies == (a, b, c)


def test_policies_are_frozen_and_hashable() -> None:
    policy = KeepLast(3) | KeepBest(1) | Pin([1, 2])
    assert hash(policy) == hash(KeepLast(3) | KeepBest(1) | Pin([2, 1]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        KeepLast(3).n = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Pin([1]).steps = (2,)  # type: ignore[misc]


def test_or_with_a_non_policy_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unsupported operand"):
        KeepLast(3) | 3  # type: ignore[operator]
    with pytest.raises(TypeError, match="unsupported operand"):
        "last" | KeepLast(3)  # type: ignore[operator]


INVALID_ARGUMENTS: list[object] = [
    pytest.param(
        lambda: KeepLast(0), ValueError, r"KeepLast\(n\) must be >= 1, got 0", id="last-0"
    ),
    pytest.param(lambda: KeepLast(-2), ValueError, r"must be >= 1, got -2", id="last-negative"),
    pytest.param(
        lambda: KeepLast(2.5), TypeError, r"must be an int >= 1, got float", id="last-float"
    ),
    pytest.param(lambda: KeepLast("3"), TypeError, r"must be an int >= 1, got str", id="last-str"),
    pytest.param(lambda: KeepLast(True), TypeError, r"got bool", id="last-bool"),
    pytest.param(lambda: KeepBest(0), ValueError, r"KeepBest\(k\) must be >= 1", id="best-0"),
    pytest.param(
        lambda: KeepBest(None), TypeError, r"KeepBest\(k\) must be an int", id="best-none"
    ),
    pytest.param(
        lambda: KeepBest(1, metric=""), ValueError, r"non-empty metric name", id="best-empty-metric"
    ),
    pytest.param(
        lambda: KeepBest(1, metric=3),
        TypeError,
        r"metric name \(str\), got int",
        id="best-int-metric",
    ),
    pytest.param(
        lambda: KeepBest(1, mode="minimize"),
        ValueError,
        r"'min' .* or 'max' .*got 'minimize'",
        id="best-bad-mode",
    ),
    pytest.param(
        lambda: KeepBest(1, "eval_loss"), TypeError, r"positional", id="best-metric-is-keyword-only"
    ),
    pytest.param(lambda: KeepEvery(0), ValueError, r"KeepEvery\(k\) must be >= 1", id="every-0"),
    pytest.param(lambda: KeepEvery(None), TypeError, r"must be an int", id="every-none"),
    pytest.param(
        lambda: Pin(1000), TypeError, r"iterable of int steps.*got int", id="pin-bare-int"
    ),
    pytest.param(lambda: Pin("1000"), TypeError, r"iterable of int steps.*got str", id="pin-str"),
    pytest.param(lambda: Pin([-1]), ValueError, r"Pin\(steps\): step must be", id="pin-negative"),
    pytest.param(lambda: Pin([1.5]), TypeError, r"Pin\(steps\): step must be", id="pin-float"),
    pytest.param(lambda: AnyOf(), ValueError, r"at least one policy", id="any-of-empty"),
    pytest.param(lambda: AnyOf(KeepLast(1), 3), TypeError, r"got int 3", id="any-of-non-policy"),
]


@pytest.mark.parametrize(("make", "error", "message"), INVALID_ARGUMENTS)
def test_invalid_arguments_are_clear_errors(
    make: Callable[[], object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()


class KeepNames:
    """A broken user policy: returns names, which would match no step."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        return frozenset(f"checkpoint-{c.step}" for c in checkpoints)  # type: ignore[misc]


class KeepNumber:
    """A broken user policy: returns one int instead of a set."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        return 3  # type: ignore[return-value]


PLAN_ERRORS: list[object] = [
    pytest.param(
        KeepLast(1),
        [ck(100), ck(200, created=5.0), ck(200)],
        ValueError,
        r"step 200 is listed twice",
        id="duplicate-steps",
    ),
    pytest.param(
        None, [ck(1), ck(1)], ValueError, r"step 1 is listed twice", id="duplicate-no-policy"
    ),
    pytest.param(3, series(1, 2), TypeError, r"policy must be a RetentionPolicy", id="int-policy"),
    pytest.param(
        KeepLast(1), [1, 2], TypeError, r"CheckpointInfo objects, got int", id="ints-not-infos"
    ),
    pytest.param(KeepLast(1), ck(1), TypeError, r"got a single one", id="single-info"),
    pytest.param(
        KeepLast(1),
        [dataclasses.replace(ck(1), step=-1)],
        ValueError,
        r"/ckpt/checkpoint-1.*non-negative",
        id="negative-step",
    ),
    pytest.param(
        KeepNames(), series(1, 2), TypeError, r"must return int steps", id="policy-returns-str"
    ),
    pytest.param(
        KeepNumber(),
        series(1, 2),
        TypeError,
        r"must return a set of int steps",
        id="policy-returns-int",
    ),
]


@pytest.mark.parametrize(("policy", "checkpoints", "error", "message"), PLAN_ERRORS)
def test_plan_errors(
    policy: object, checkpoints: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        plan_deletions(policy, checkpoints)  # type: ignore[arg-type]
    with pytest.raises(error, match=message):
        describe_plan(policy, checkpoints)  # type: ignore[arg-type]


def test_policy_keep_rejects_duplicate_steps() -> None:
    with pytest.raises(ValueError, match="step 5 is listed twice"):
        KeepLast(3).keep([ck(5), ck(5)])


# Property tests: any policy combination over any list of committed checkpoints.

STEPS = st.integers(min_value=0, max_value=300)
METRIC_VALUES = st.one_of(
    st.none(),
    st.just(NAN),
    st.sampled_from([0.0, 0.5, 1.0]),  # repeated values, so ties happen often
    st.floats(min_value=-10, max_value=10, allow_nan=False),
)
CHECKPOINT_LISTS = st.lists(
    st.tuples(STEPS, METRIC_VALUES, st.floats(min_value=0, max_value=2e9)),
    unique_by=lambda row: row[0],
    max_size=25,
).map(lambda rows: [ck(step, loss, created=created) for step, loss, created in rows])
LEAF_POLICIES = st.one_of(
    st.builds(KeepLast, st.integers(min_value=1, max_value=8)),
    st.builds(
        lambda k, mode: KeepBest(k, metric="eval_loss", mode=mode),
        st.integers(min_value=1, max_value=5),
        st.sampled_from(["min", "max"]),
    ),
    st.builds(KeepEvery, st.integers(min_value=1, max_value=100)),
    st.builds(Pin, st.lists(STEPS, max_size=5)),
    st.just(KeepAll()),
)
POLICIES = st.lists(LEAF_POLICIES, min_size=1, max_size=4).map(
    lambda leaves: functools.reduce(operator.or_, leaves)
)


def expected_kept_by(policy: RetentionPolicy, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
    """An independent statement of what each built-in policy keeps."""
    steps = {c.step for c in checkpoints}
    if isinstance(policy, KeepLast):
        return set(sorted(steps)[-policy.n :])
    if isinstance(policy, KeepBest):
        sign = 1 if policy.mode == "min" else -1
        eligible = {
            c.step: sign * c.metrics["eval_loss"]
            for c in checkpoints
            if "eval_loss" in c.metrics and not math.isnan(c.metrics["eval_loss"])
        }
        # Kept iff fewer than k others are strictly better, or equal and newer.
        return {
            step
            for step, value in eligible.items()
            if sum(v < value or (v == value and s > step) for s, v in eligible.items()) < policy.k
        }
    if isinstance(policy, KeepEvery):
        return {s for s in steps if s % policy.k == 0}
    if isinstance(policy, Pin):
        return steps & set(policy.steps)
    if isinstance(policy, KeepAll):
        return steps
    raise AssertionError(f"no oracle for {policy!r}")


@settings(max_examples=300, deadline=None)
@given(policy=POLICIES, checkpoints=CHECKPOINT_LISTS, data=st.data())
def test_plan_properties(
    policy: RetentionPolicy, checkpoints: list[CheckpointInfo], data: st.DataObject
) -> None:
    deleted = deleted_steps(policy, checkpoints)
    all_steps = {c.step for c in checkpoints}
    rows = describe_plan(policy, checkpoints)
    kept = {info.step for info, is_kept, _ in rows if is_kept}

    assert deleted == sorted(set(deleted))
    assert kept | set(deleted) == all_steps
    assert kept.isdisjoint(deleted)
    if checkpoints:
        assert max(all_steps) not in deleted

    leaves = policy.policies if isinstance(policy, AnyOf) else (policy,)
    oracle = set().union(*(expected_kept_by(leaf, checkpoints) for leaf in leaves))
    assert set(deleted) == all_steps - oracle - {max(all_steps, default=-1)}
    for leaf in leaves:
        assert leaf.keep(checkpoints) == expected_kept_by(leaf, checkpoints)
        if isinstance(leaf, KeepLast):
            newest = sorted(all_steps, reverse=True)[: min(leaf.n, len(all_steps))]
            assert not set(newest) & set(deleted)
        if isinstance(leaf, KeepBest):
            eligible = [c for c in checkpoints if not math.isnan(c.metrics.get("eval_loss", NAN))]
            assert len(leaf.keep(checkpoints)) == min(leaf.k, len(eligible))

    # Neither input order nor created_unix changes the plan.
    shuffled = data.draw(st.permutations(checkpoints))
    created = data.draw(
        st.lists(st.floats(0, 2e9), min_size=len(checkpoints), max_size=len(checkpoints))
    )
    restamped = [
        dataclasses.replace(c, created_unix=t) for c, t in zip(shuffled, created, strict=True)
    ]
    assert deleted_steps(policy, restamped) == deleted


@settings(max_examples=100, deadline=None)
@given(checkpoints=CHECKPOINT_LISTS)
def test_no_policy_and_keep_all_delete_nothing(checkpoints: list[CheckpointInfo]) -> None:
    assert plan_deletions(None, checkpoints) == []
    assert plan_deletions(KeepAll(), checkpoints) == []
    assert all(is_kept for _, is_kept, _ in describe_plan(None, checkpoints))


def test_unrecorded_metrics_names_keep_best_rules_no_checkpoint_records():
    checkpoints = [ck(1, 0.5), ck(2, train_loss=0.4), ck(3)]
    typo = KeepLast(2) | KeepBest(1, metric="eval-loss") | KeepBest(1, metric="eval_loss")
    assert unrecorded_metrics(typo, checkpoints) == {"eval-loss": ["eval_loss", "train_loss"]}
    assert unrecorded_metrics(KeepBest(1, metric="acc"), [ck(1)]) == {"acc": []}
    assert unrecorded_metrics(KeepBest(1), checkpoints) == {}
    assert unrecorded_metrics(KeepBest(1, metric="acc"), []) == {}
    assert unrecorded_metrics(KeepLast(1), checkpoints) == {}
    assert unrecorded_metrics(None, checkpoints) == {}
