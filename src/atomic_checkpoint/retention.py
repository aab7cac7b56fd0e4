"""Retention: which committed checkpoints to keep (pure: no I/O).

A retention policy looks at this run's committed checkpoints and names the steps it
keeps. Policies compose with ``|``: a checkpoint is kept if *any* policy keeps it::

    policy = KeepLast(3) | KeepBest(1, metric="eval_loss", mode="min") | KeepEvery(10_000)
    for info in plan_deletions(policy, checkpoints):
        ...  # the coordinator un-commits, then deletes, each one

Retention is a set computation, never a sort-and-swap (FAILURE_MODES B3): the plan
deletes exactly the checkpoints that no policy keeps, and the newest committed
checkpoint is kept whatever the policy says. Recency is the integer step and nothing
else: not mtime, not ``created_unix``, not the string order of names (B1, B2).

Everything here is pure: no I/O, no clock, no randomness, and the result does not
depend on the order of the input, so every rank and every storage domain given the
same checkpoints computes the same plan (B8). The coordinator calls it after a commit
is durable (B4), passing only the committed checkpoints of this run (B7): filtering by
run id and applying the plan (un-commit, then delete, tolerating ENOENT) belong to the
callers. Because the plan is recomputed from what is committed each time, a resumed
run counts its pre-restart checkpoints like any others (B6).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Literal, Protocol, runtime_checkable

from .layout import validate_step
from .manifest import CheckpointInfo

__all__ = [
    "AnyOf",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Pin",
    "RetentionPolicy",
    "describe_plan",
    "plan_deletions",
    "unrecorded_metrics",
]


@runtime_checkable
class RetentionPolicy(Protocol):
    """The role of a retention policy: name the steps it keeps.

    Pure: no I/O; called on the coordinator after a commit is durable. Any object with
    this method is a policy; the built-in ones also compose with ``|``.
    """

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        """The steps this policy keeps.

        Called by :func:`plan_deletions` and :func:`describe_plan` on the coordinator,
        from the thread that finished the commit; it must not block or do I/O, and it
        must return the same answer for the same checkpoints (it is idempotent).

        Args:
            checkpoints: this run's committed checkpoints, in any order. A policy orders
                them by integer ``step`` itself, never by ``created_unix`` or by name.
                With node-local disks (several storage domains) every node's leader
                decides alike from what the commit exchanges: ``step``, ``metrics``,
                ``created_unix``, ``run_id`` and ``path``; ``metadata`` is empty and
                ``size_bytes`` 0 there, so decide from metrics (record a milestone as
                a metric, e.g. ``metrics={"milestone": 1}``).

        Returns:
            The kept steps. Steps that are not in ``checkpoints`` are ignored. Steps
            not returned are deleted unless another policy keeps them, except the
            newest, which is always kept.
        """
        ...


class _Composable:
    """Shared behaviour of the built-in policies: ``keep`` from ``reasons``, and ``|``."""

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept, for ``describe_plan`` and logs.

        Pure: no I/O; called on the coordinator after a commit is durable. Each policy
        names its reason in its own docstring.

        Args:
            checkpoints: this run's committed checkpoints, in any order.

        Returns:
            The kept steps, each mapped to its reason.
        """
        raise NotImplementedError  # pragma: no cover - every subclass overrides it

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
        """The steps this policy keeps; see :meth:`RetentionPolicy.keep`.

        Pure: no I/O; called on the coordinator after a commit is durable.

        Args:
            checkpoints: this run's committed checkpoints, in any order.

        Returns:
            The kept steps, a subset of the steps of ``checkpoints``.

        Raises:
            ValueError: a step appears more than once.
            TypeError: an element is not a :class:`CheckpointInfo`.
        """
        return frozenset(self.reasons(checkpoints))

    def __or__(self, other: object) -> AnyOf:
        if not _is_policy(other):
            return NotImplemented
        return AnyOf(self, other)  # type: ignore[arg-type]

    def __ror__(self, other: object) -> AnyOf:
        if not _is_policy(other):
            return NotImplemented
        return AnyOf(other, self)  # type: ignore[arg-type]


class _Counted(_Composable):
    """A built-in policy whose first field is a count of at least 1 (``KeepLast(n)``,
    ``KeepEvery(k)``, ``KeepBest(k, ...)``): checked when it is made, shown as
    ``Name(count)`` unless the policy has more to show."""

    def __post_init__(self) -> None:
        name = dataclasses.fields(self)[0].name  # type: ignore[arg-type]
        value = _check_count(type(self).__name__, name, getattr(self, name))
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        name = dataclasses.fields(self)[0].name  # type: ignore[arg-type]
        return f"{type(self).__name__}({getattr(self, name)})"


@dataclass(frozen=True, repr=False)
class KeepLast(_Counted):
    """Keep the ``n`` checkpoints with the highest steps.

    Pure: no I/O; called on the coordinator after a commit is durable.

    Args:
        n: how many of the newest checkpoints to keep, at least 1.

    Raises:
        TypeError: ``n`` is not an int.
        ValueError: ``n`` is less than 1.
    """

    n: int

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: ``"last <n>"``; see :meth:`_Composable.reasons`."""
        newest_first = sorted(_index(checkpoints), reverse=True)
        return dict.fromkeys(newest_first[: self.n], f"last {self.n}")


@dataclass(frozen=True, repr=False)
class KeepBest(_Counted):
    """Keep the ``k`` checkpoints with the best value of a metric.

    Pure: no I/O; called on the coordinator after a commit is durable.

    A checkpoint whose metrics lack ``metric``, or hold NaN or a non-number there, is
    never among the best; it is simply not kept by this policy (another policy may
    keep it). Ties are broken deterministically in favour of the newer step: with
    ``k=1`` and equal losses at steps 200 and 400, step 400 is kept.

    Args:
        k: how many of the best checkpoints to keep, at least 1.
        metric: the key in ``CheckpointInfo.metrics``.
        mode: ``"min"`` if lower is better (losses), ``"max"`` if higher is better.

    Raises:
        TypeError: ``k`` is not an int or ``metric`` is not a string.
        ValueError: ``k`` is less than 1, ``metric`` is empty, or ``mode`` is neither
            ``"min"`` nor ``"max"``.
    """

    k: int
    _: KW_ONLY
    metric: str = "eval_loss"
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.metric, str):
            raise TypeError(
                f"KeepBest(metric=...) must be a metric name (str), "
                f"got {type(self.metric).__name__} {self.metric!r}"
            )
        if not self.metric:
            raise ValueError("KeepBest(metric=...) must be a non-empty metric name")
        if self.mode not in ("min", "max"):
            raise ValueError(
                f"KeepBest(mode=...) must be 'min' (lower is better) or 'max' "
                f"(higher is better), got {self.mode!r}"
            )

    def __repr__(self) -> str:
        return f"KeepBest({self.k}, metric={self.metric!r}, mode={self.mode!r})"

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: ``"best <metric>=<value>"``; see
        :meth:`_Composable.reasons`."""
        sign = 1.0 if self.mode == "min" else -1.0
        ranked: list[tuple[float, int, float]] = []
        for step, info in _index(checkpoints).items():
            value = _metric_value(info, self.metric)
            if value is not None:
                # Best first; among equal values the newer step first.
                ranked.append((sign * value, -step, value))
        ranked.sort()
        return {
            -neg_step: f"best {self.metric}={value:.6g}" for _, neg_step, value in ranked[: self.k]
        }


@dataclass(frozen=True, repr=False)
class KeepEvery(_Counted):
    """Keep every checkpoint whose step is a multiple of ``k`` (step 0 included).

    Pure: no I/O; called on the coordinator after a commit is durable.

    Args:
        k: the step interval, at least 1.

    Raises:
        TypeError: ``k`` is not an int.
        ValueError: ``k`` is less than 1.
    """

    k: int

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: ``"every <k>"``; see :meth:`_Composable.reasons`."""
        return {step: f"every {self.k}" for step in _index(checkpoints) if step % self.k == 0}


@dataclass(frozen=True, init=False, repr=False)
class Pin(_Composable):
    """Keep the checkpoints at these explicit steps.

    Pure: no I/O; called on the coordinator after a commit is durable. Pinned steps
    that have no committed checkpoint are ignored.

    Args:
        steps: the steps to keep, e.g. ``Pin([1000, 5000])``; duplicates are merged.

    Raises:
        TypeError: ``steps`` is not an iterable of ints (a bare int or a string
            included).
        ValueError: a step is negative or too large.
    """

    steps: tuple[int, ...]

    def __init__(self, steps: Iterable[int]) -> None:
        if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
            raise TypeError(
                f"Pin(steps) takes an iterable of int steps such as Pin([1000, 5000]), "
                f"got {type(steps).__name__} {steps!r}"
            )
        checked = set()
        for step in steps:
            try:
                checked.add(validate_step(step))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"Pin(steps): {exc}") from None
        object.__setattr__(self, "steps", tuple(sorted(checked)))

    def __repr__(self) -> str:
        return f"Pin({list(self.steps)!r})"

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: ``"pinned"``; see :meth:`_Composable.reasons`."""
        pinned = frozenset(self.steps)
        return {step: "pinned" for step in _index(checkpoints) if step in pinned}


@dataclass(frozen=True, repr=False)
class KeepAll(_Composable):
    """Keep every checkpoint (retention off).

    Pure: no I/O; called on the coordinator after a commit is durable.
    """

    def __repr__(self) -> str:
        return "KeepAll()"

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: ``"keep all"`` (every step); see
        :meth:`_Composable.reasons`."""
        return dict.fromkeys(_index(checkpoints), "keep all")


@dataclass(frozen=True, init=False, repr=False)
class AnyOf(_Composable):
    """Keep a checkpoint if any of ``policies`` keeps it; what ``a | b`` builds.

    Pure: no I/O; called on the coordinator after a commit is durable. Nested
    ``AnyOf`` are flattened, so ``(a | b) | c == a | (b | c) == AnyOf(a, b, c)``, and
    its repr reads like the expression that built it:
    ``KeepLast(3) | KeepBest(1, metric='eval_loss', mode='min')``.

    Args:
        *policies: at least one policy; any object with a ``keep(checkpoints)`` method.

    Raises:
        TypeError: a policy has no ``keep`` method.
        ValueError: no policy is given.
    """

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("AnyOf() needs at least one policy, e.g. AnyOf(KeepLast(3))")
        flat: list[RetentionPolicy] = []
        for policy in policies:
            _check_policy(policy, where="AnyOf")
            flat.extend(policy.policies if isinstance(policy, AnyOf) else (policy,))
        object.__setattr__(self, "policies", tuple(flat))

    def __repr__(self) -> str:
        if len(self.policies) == 1:
            return f"AnyOf({self.policies[0]!r})"
        return " | ".join(repr(policy) for policy in self.policies)

    def reasons(self, checkpoints: Sequence[CheckpointInfo]) -> dict[int, str]:
        """Why each kept step is kept: the reasons of every policy that keeps it,
        joined by ``", "``; see :meth:`_Composable.reasons`."""
        ordered = _ordered(checkpoints)
        merged: dict[int, list[str]] = {}
        for policy in self.policies:
            for step, reason in _policy_reasons(policy, ordered).items():
                merged.setdefault(step, []).append(reason)
        return {step: ", ".join(reasons) for step, reasons in merged.items()}


def plan_deletions(
    policy: RetentionPolicy | None,
    checkpoints: Sequence[CheckpointInfo],
    *,
    protect: Iterable[int] = (),
) -> list[CheckpointInfo]:
    """The checkpoints to delete: every one that ``policy`` does not keep.

    Pure: no I/O; called on the coordinator after a commit is durable. The newest
    committed checkpoint (the highest step) is never in the plan, whatever the policy
    says, so even ``KeepBest`` alone leaves the checkpoint a resume would load; nor is
    any step in ``protect``.

    Args:
        policy: the retention policy, or None to keep everything.
        checkpoints: this run's committed checkpoints, in any order; the caller has
            already left out other runs' checkpoints and anything not committed.
        protect: steps never to delete: the manager passes the step its save just
            committed, which its own retention pass must keep (DESIGN invariant 10),
            even if a higher step exists.

    Returns:
        The checkpoints to delete, ascending by step; empty for empty input.

    Raises:
        ValueError: a step appears more than once in ``checkpoints``.
        TypeError: ``policy`` is not a policy, an element of ``checkpoints`` is not a
            :class:`CheckpointInfo`, or ``policy.keep`` returned something other than
            int steps (a set, or any iterable of them, such as a list).
    """
    _check_policy(policy, where="plan_deletions")
    ordered = _ordered(checkpoints)
    if not ordered:
        return []
    if policy is None:
        return []
    kept = _kept_steps(policy, ordered) | frozenset(protect)
    newest = ordered[-1].step
    return [info for info in ordered if info.step != newest and info.step not in kept]


def plan_keeping_a_verified_newest(
    policy: RetentionPolicy | None,
    checkpoints: Sequence[CheckpointInfo],
    verifies: Callable[[int], bool],
    *,
    protect: Iterable[int] = (),
    every_kept: bool = False,
) -> tuple[list[int], list[CheckpointInfo]]:
    """``plan_deletions``, made safe against a corrupt newest checkpoint: the newest
    one the plan keeps (what a resume would load, and what makes deleting the others
    safe) must pass ``verifies(step)`` (a full read; the caller may know it good
    already). One that fails is set aside, neither kept nor deleted, and the plan is
    made again without it, so a corrupt newest never makes retention delete the last
    checkpoint that can be restored. With ``every_kept``, every checkpoint the plan
    keeps must verify, newest first (``prune``: ``--keep-last 2`` leaves two good
    ones, not a bit-rotted one counted as kept). Nothing is verified when nothing would
    be deleted, unless ``every_kept`` and a corrupt one was found: then every kept one
    is, so that what is reported corrupt is all of it. Each step at most once.

    Returns:
        The steps to delete, and the checkpoints the plan was made of (``checkpoints``
        less the ones set aside).
    """
    infos = list(checkpoints)
    good: set[int] = set()
    found_corrupt = False
    while True:
        victims = [v.step for v in plan_deletions(policy, infos, protect=protect)]
        kept = sorted((i.step for i in infos if i.step not in victims), reverse=True)
        if not kept or not (victims or (every_kept and found_corrupt)):
            return victims, infos
        bad = next(
            (s for s in kept[: None if every_kept else 1] if s not in good and not verifies(s)),
            None,
        )
        if bad is None:
            return victims, infos
        found_corrupt = True
        good.update(s for s in kept if s > bad)
        infos = [i for i in infos if i.step != bad]


def describe_plan(
    policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointInfo]
) -> list[tuple[CheckpointInfo, bool, str]]:
    """Each checkpoint, whether it is kept, and why: for ``prune --dry-run`` and logs.

    Pure: no I/O; called on the coordinator after a commit is durable, or by the CLI.
    Agrees with :func:`plan_deletions`: a checkpoint is reported as not kept exactly
    when it is in the plan.

    Reasons look like ``"newest, last 3"``, ``"best eval_loss=0.12"``,
    ``"every 1000"``, ``"pinned"``, ``"keep all"``, ``"no retention policy"``, or for a
    deleted checkpoint ``"not kept by KeepLast(3) | KeepEvery(1000)"``. A policy that is
    not one of the built-in ones is named by its repr (``"kept by MyPolicy()"``).

    Args:
        policy: the retention policy, or None to keep everything.
        checkpoints: this run's committed checkpoints, in any order.

    Returns:
        ``(checkpoint, is_kept, reason)`` for every checkpoint, ascending by step.

    Raises:
        ValueError: a step appears more than once in ``checkpoints``.
        TypeError: as for :func:`plan_deletions`.
    """
    _check_policy(policy, where="describe_plan")
    ordered = _ordered(checkpoints)
    if not ordered:
        return []
    reasons = _policy_reasons(policy, ordered) if policy is not None else None
    newest = ordered[-1].step
    rows: list[tuple[CheckpointInfo, bool, str]] = []
    for info in ordered:
        why = ["newest"] if info.step == newest else []
        if reasons is None:
            why.append("no retention policy")
        elif info.step in reasons:
            why.append(reasons[info.step])
        if why:
            rows.append((info, True, ", ".join(why)))
        else:
            rows.append((info, False, f"not kept by {policy!r}"))
    return rows


def unrecorded_metrics(
    policy: RetentionPolicy | None, checkpoints: Sequence[CheckpointInfo]
) -> dict[str, list[str]]:
    """The metrics of ``policy``'s ``KeepBest`` rules (in an ``AnyOf`` too) that none of
    ``checkpoints`` records, each with the metric names they do record, sorted: such a
    rule keeps nothing, which is most often a misspelt name (``"eval-loss"`` for
    ``"eval_loss"``). Empty when there are no checkpoints. Pure."""
    if policy is None or not checkpoints:
        return {}
    recorded = sorted({name for info in checkpoints for name in info.metrics})
    out: dict[str, list[str]] = {}
    for part in policy.policies if isinstance(policy, AnyOf) else (policy,):
        if isinstance(part, KeepBest) and part.metric not in recorded:
            out[part.metric] = recorded
    return out


def _check_count(cls: str, arg: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{cls}({arg}) must be an int >= 1, got bool {value!r}")
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{cls}({arg}) must be an int >= 1, got {type(value).__name__} {value!r}"
        ) from None
    if count < 1:
        raise ValueError(
            f"{cls}({arg}) must be >= 1, got {count}; the newest checkpoint is always "
            f"kept, so {cls}(1) is the smallest useful value"
        )
    return count


def _is_policy(obj: object) -> bool:
    return callable(getattr(obj, "keep", None))


def _check_policy(policy: object, *, where: str) -> None:
    if isinstance(policy, type):
        # ``KeepLast(1) | MyPolicy`` (no parentheses): as a policy it failed at every
        # rotation, so nothing was ever deleted and the disk filled.
        raise TypeError(
            f"{where}: a policy object such as {policy.__name__}(...) is needed, not the "
            f"class {policy.__name__} itself"
        )
    if policy is not None and not _is_policy(policy):
        raise TypeError(
            f"{where}: policy must be a RetentionPolicy such as KeepLast(3) "
            f"(an object with keep(checkpoints)), or None to keep everything; "
            f"got {type(policy).__name__} {policy!r}"
        )


def _index(checkpoints: Iterable[CheckpointInfo]) -> dict[int, CheckpointInfo]:
    """The checkpoints by validated integer step; duplicates are an error."""
    if isinstance(checkpoints, CheckpointInfo):
        raise TypeError("checkpoints must be a sequence of CheckpointInfo, got a single one")
    index: dict[int, CheckpointInfo] = {}
    for info in checkpoints:
        if not isinstance(info, CheckpointInfo):
            raise TypeError(
                f"checkpoints must hold CheckpointInfo objects, got {type(info).__name__} {info!r}"
            )
        try:
            step = validate_step(info.step)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"checkpoint {info.path!r}: {exc}") from None
        if step in index:
            raise ValueError(
                f"step {step} is listed twice ({index[step].path!r} and {info.path!r}); "
                f"each committed step must appear once, so the list is not this run's "
                f"committed checkpoints"
            )
        index[step] = info
    return index


def _ordered(checkpoints: Iterable[CheckpointInfo]) -> tuple[CheckpointInfo, ...]:
    """The checkpoints ascending by integer step, validated by :func:`_index`."""
    index = _index(checkpoints)
    return tuple(index[step] for step in sorted(index))


def _metric_value(info: CheckpointInfo, metric: str) -> float | None:
    """The metric as a float, or None if it is missing, NaN, or not a number."""
    value = info.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    as_float = float(value)
    return None if math.isnan(as_float) else as_float


def _kept_steps(policy: RetentionPolicy, checkpoints: Sequence[CheckpointInfo]) -> frozenset[int]:
    """``policy.keep(checkpoints)``, checked to be int steps (a string would keep nothing)."""
    result = policy.keep(checkpoints)
    try:
        steps = frozenset(result)
    except TypeError:
        raise TypeError(
            f"{policy!r}.keep() must return a set of int steps, got {type(result).__name__}"
        ) from None
    for step in steps:
        # numpy's integers too (a policy that ranks steps with np.argsort returns them).
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(
                f"{policy!r}.keep() must return int steps, got {type(step).__name__} {step!r}"
            )
    return frozenset(int(step) for step in steps)


def _policy_reasons(
    policy: RetentionPolicy, checkpoints: Sequence[CheckpointInfo]
) -> dict[int, str]:
    """Kept steps with reasons; a policy that is not built in is named by its repr.

    A subclass of a built-in policy that overrides ``keep`` is asked ``keep``: its
    ``reasons`` are the base class's, which would drop what the override adds (a
    ``KeepLast`` that also keeps milestones lost them inside ``|``)."""
    if isinstance(policy, _Composable) and type(policy).keep is _Composable.keep:
        return policy.reasons(checkpoints)
    present = {info.step for info in checkpoints}
    kept = _kept_steps(policy, checkpoints) & present
    base = policy.reasons(checkpoints) if isinstance(policy, _Composable) else {}
    return {step: base.get(step, f"kept by {policy!r}") for step in sorted(kept)}
