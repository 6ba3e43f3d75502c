"""Fenced writes for Django querysets: the token check and the stamp in the one UPDATE.

``fenced_update(queryset, lease, **values)`` is ``queryset.update(**values)``
with ``AND fence_token <= :token`` added to its WHERE and ``fence_token =
:token`` to its SET, as ``dblock.fenced_update`` does for a SQLAlchemy
``update()``. It runs on Django's connection, in the caller's transaction.
"""

from __future__ import annotations

from typing import Any

from django.db import models, router

from dblock.fencing import DEFAULT_COLUMN, TokenLike, refused, token_of


def fenced_update(
    queryset: Any, lease: TokenLike, *, column: str = DEFAULT_COLUMN, strict: bool = False, **values: Any
) -> int:
    """Update the rows of ``queryset`` that no newer lease has stamped; return how many were written.

    One UPDATE: ``SET <values>, <column> = token WHERE <queryset's filters>
    AND <column> <= token`` (``strict=True``: ``<``, each grant writes a row
    once). ``lease`` is a Lease or a bare token (an int, e.g. ``$DBLOCK_TOKEN``).

    When it wrote nothing, one more SELECT tells a refusal from an empty
    queryset: if a row the queryset matches carries a newer token (strict: this
    token or a newer one), FencedOut is raised (``.newer`` is that token);
    otherwise no row matched and 0 is returned. A queryset matching several
    rows writes those no newer lease stamped, and raises only when it wrote none.

    The model needs an integer column for the token on its own table:
    ``fence_token = FenceTokenField()`` (or ``models.BigIntegerField(default=0)``),
    or another name given as ``column``. Bad arguments raise TypeError or
    ValueError before any SQL.
    """
    token = token_of(lease)
    if not isinstance(queryset, models.QuerySet):
        raise TypeError(
            f"fenced_update needs a QuerySet, e.g. Model.objects.filter(...), not {type(queryset).__name__}"
        )
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, not {type(strict).__name__}")
    if queryset.query.is_sliced:
        raise TypeError(
            "fenced_update cannot update a sliced queryset (neither can QuerySet.update); filter it instead"
        )
    model = queryset.model
    fence = _own_field(model, column, "the fence column")
    if not isinstance(fence, models.BigIntegerField):
        raise ValueError(
            f"{model.__name__}.{column} must be a BigIntegerField to hold fencing tokens (up to 2**63 - 1), "
            f"not {type(fence).__name__}: use FenceTokenField()"
        )
    if fence.null:
        # NULL <= token is not true: a NULL fence would refuse every write, silently.
        raise ValueError(f"{model.__name__}.{column} must be NOT NULL with default 0, not null=True")
    if column in values or fence.attname in values:
        raise ValueError(f"do not set {column!r} yourself: the fence stamps it with the lease's token")
    for name in values:
        _own_field(model, name, "a value")

    using = _write_database(queryset)
    if queryset.query.count_active_tables() <= 1:
        rows = queryset.using(using)
    else:
        # Filters through a relation: Django would move the whole WHERE, fence
        # included, into "pk IN (SELECT ...)", where it is checked on the
        # statement's snapshot of the row. After waiting for a newer holder's
        # uncommitted stamp, PostgreSQL re-checks only the WHERE of the row it
        # updates, so the fence must stay there, on the row itself.
        rows = model._base_manager.using(using).filter(pk__in=queryset.values("pk"))
    passes = f"{column}__lt" if strict else f"{column}__lte"
    written: int = rows.filter(**{passes: token}).update(**values, **{column: token})
    if written == 0:
        # Under READ COMMITTED a new snapshot: it sees the newer write that
        # made the UPDATE skip a row it had waited for.
        beats = f"{column}__gte" if strict else f"{column}__gt"
        newer = rows.filter(**{beats: token}).order_by(f"-{column}").values_list(column, flat=True).first()
        if newer is not None:
            raise refused(token, f"table {model._meta.db_table!r}", newer, strict)
    return written


def _own_field(model: Any, name: str, what: str) -> Any:
    """The field ``name`` of ``model``, stored in the model's own table; ValueError otherwise.

    A field of a multi-table parent is written by a second UPDATE of the
    parent's table, which the fence in the first would not guard.
    """
    try:
        field = model._meta.get_field(name)
    except Exception:  # noqa: BLE001 - FieldDoesNotExist, or a name that is not a str
        hint = " (add fence_token = FenceTokenField())" if what == "the fence column" else ""
        raise ValueError(f"{model.__name__} has no field {name!r} for {what}{hint}") from None
    if not getattr(field, "concrete", False) or field.many_to_many or field.one_to_many:
        raise ValueError(f"{model.__name__}.{name} is not a column of its table, so it cannot be {what}")
    if field.model._meta.concrete_model is not model._meta.concrete_model:
        raise ValueError(
            f"{model.__name__}.{name} is stored in {field.model.__name__}'s table, not {model.__name__}'s: "
            f"fence {field.model.__name__}'s rows instead (one table, one UPDATE)"
        )
    return field


def _write_database(queryset: Any) -> str:
    """The database ``queryset.update()`` would write to: the one set with ``using()``, else the router's.

    The SELECT that tells a refusal from no rows must read there too (a
    replica could lag behind the newer token).
    """
    chosen: str | None = queryset._db
    return chosen or router.db_for_write(queryset.model, **queryset._hints)
