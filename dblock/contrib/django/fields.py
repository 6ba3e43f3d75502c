"""``FenceTokenField``: the column a fenced write checks and stamps."""

from __future__ import annotations

from typing import Any

from django.db import models


class FenceTokenField(models.BigIntegerField):
    """A fencing token column: BIGINT NOT NULL, 0 in a new row, changed only by fenced writes.

    ``fenced_update`` compares and stamps it. A plain ``save()`` of a loaded
    object leaves it as stored (its UPDATE writes ``fence_token = fence_token``):
    writing back the token loaded earlier would lower the fence if a newer
    lease stamped the row meanwhile, and let an older lease's late write
    through. Not editable in forms and the admin.
    """

    description = "A fencing token (dblock)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("editable", False)
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        # Migrations record only what differs from this field's own defaults.
        name, path, args, kwargs = super().deconstruct()
        if kwargs.get("default") == 0:
            del kwargs["default"]
        if self.editable:
            kwargs["editable"] = True
        else:
            kwargs.pop("editable", None)
        return name, path, args, kwargs

    def pre_save(self, model_instance: Any, add: bool) -> Any:
        if add:
            return super().pre_save(model_instance, add)
        return models.F(self.attname)  # an UPDATE from save() keeps the stored token
